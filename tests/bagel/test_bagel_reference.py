"""Our BAGEL against outputs of the public reference implementation (ByteDance-Seed/Bagel, fp32,
CPU; data/README.md) on the same tiny checkpoint: the ViT, the MoT layer stack (mixed
understanding / generation rows over a cached text block: hidden states and cached K/V), one flow
step's three CFG velocities and their combination under each renorm, and whole requests
(understanding, text-to-image, editing, think mode) with the reference's noise.

Tolerance: 1e-4 of the largest magnitude (``rel_err``) everywhere; decoded tokens exact; pixels
(uint8, truncated as the reference does) within 1 level."""

import dataclasses

import pytest
import torch
from bagel_checks import rel_err

from mstar.models.bagel.flow import FlowParams, cfg_combine, draw_noise
from mstar.services.engines.kv_engine import ForwardItem

TOL = 1e-4


def reference_tensors():
    from bagel_checks import DATA
    from safetensors.torch import load_file

    return load_file(str(DATA / "bagel_reference.safetensors"))


def scenario_image(spec):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
    from make_reference import image  # the same test image (numpy + PIL only)

    return image(*spec)


def test_noise_follows_the_reference_stream(reference):
    t, meta = reference
    torch.testing.assert_close(draw_noise(7, 15, 64)[1], t["t2i.noise"], rtol=0, atol=0)
    eps, noise = draw_noise(11, 24, 64, (1, 16, 8, 12))
    assert eps.shape == (1, 16, 8, 12)
    torch.testing.assert_close(noise, t["edit.noise"], rtol=0, atol=0)


def test_vit_matches(pipeline, reference):
    t, _ = reference
    vit = pipeline.vit
    ims = [t["vit.pixels0"], t["vit.pixels1"]]  # 70x42 and 42x70: a transposed grid shows
    from mstar.models.bagel.vit import patch_position_ids, patchify

    ids = torch.cat([patch_position_ids(i.shape[1], i.shape[2], 14, 70) for i in ims])
    hidden = vit.encode(torch.cat([patchify(i, 14) for i in ims]), ids, [15, 15])
    assert rel_err(hidden, t["vit.hidden"]) < TOL
    assert rel_err(torch.cat(vit(ims)), t["vit.embeds"]) < TOL


def test_mot_layers_match(pipeline, reference):
    """Text (understanding) then [soi, 6 latents, eoi] with the markers on the understanding expert
    and the latents on the generation expert, one softmax over all: hidden states and K/V."""
    t, _ = reference
    lm, rid = pipeline.lm, "mot"
    try:
        ids = t["mot.text_ids"]
        lm.prefill_text([(rid, ("main",), ids)])
        n, rope = t["mot.input"].shape[0], len(ids)
        rows = torch.ones(n, dtype=torch.bool)
        rows[0] = rows[-1] = False
        (hidden,) = lm._pass([ForwardItem(rid, "main", embeds=t["mot.input"], positions=torch.full((n,), rope))], rows,
                             causal=False)
        assert rel_err(hidden, t["mot.hidden"]) < TOL
        kv = lm.engine.export_kv(rid, "main")  # [layers, 2, tokens, kv_heads, head_dim]
        for layer in (0, kv.shape[0] - 1):
            assert rel_err(kv[layer, 0], t[f"mot.k{layer}"]) < TOL
            assert rel_err(kv[layer, 1], t[f"mot.v{layer}"]) < TOL
        assert not torch.allclose(lm.llm.layers[0].und.q_proj.weight, lm.llm.layers[0].gen.q_proj.weight)
    finally:
        lm.release(rid)


def edit_contexts(pipeline, reference, rid):
    """The edit scenario's three contexts, built by our blocks."""
    from mstar.models.bagel.flow import patchify_latent
    from mstar.models.bagel.media import normalize, to_uint8
    from mstar.models.bagel.requests import plan

    _, meta = reference
    s = meta["scenarios"]["edit"]
    image = pipeline.vae_fit(scenario_image(s["image"]))
    eps, _ = draw_noise(s["seed"], 24, 64, (1, 16, image.size[1] // 8, image.size[0] // 8))
    lm = pipeline.lm
    for b in plan("edit", False, 4.0, 2.0, s["prompt"]):
        if b.kind in ("export", "generate"):
            continue
        if b.kind == "text":
            lm.prefill_text([(rid, b.labels, pipeline.text_ids(b.text))])
        elif b.kind == "vit":
            lm.prefill_image([(rid, b.labels, pipeline.vit([normalize(to_uint8(pipeline.vit_fit(image)))])[0])], False)
        else:
            z = pipeline.vae.encode(normalize(to_uint8(image))[None], eps)[0]
            lm.prefill_image([(rid, b.labels, lm.vae_tokens(patchify_latent(z), z.shape[1] // 2, z.shape[2] // 2))], True)
    return image, z


def test_flow_step_cfg_and_renorm_match(pipeline, reference):
    t, _ = reference
    rid = "flow"
    try:
        image, z = edit_contexts(pipeline, reference, rid)
        assert rel_err(z, t["edit.vae_latent"]) < TOL
        p = FlowParams(image.size[1], image.size[0], cfg_text=4.0, cfg_img=2.0, interval=(0.0, 1.0))
        (v,) = pipeline.lm.velocities([(rid, t["flow.x_t"], 0.7, p, ("main", "cfg_text", "cfg_img"))])
        for ours, theirs in (("main", "cond"), ("cfg_text", "text"), ("cfg_img", "img")):
            assert rel_err(v[ours], t[f"flow.v_{theirs}"]) < TOL, ours
        for renorm in ("global", "channel", "text_channel"):
            got = cfg_combine(v["main"], v["cfg_text"], v["cfg_img"], 4.0, 2.0, renorm)
            assert rel_err(got, t[f"flow.v.{renorm}"]) < TOL, renorm
    finally:
        pipeline.lm.release(rid)


def test_cfg_combination_and_renorm_match():
    """On velocities far enough apart that every renorm engages (data/README.md: flow.w_*)."""
    t = reference_tensors()
    outs = {}
    for renorm in ("global", "channel", "text_channel"):
        got = cfg_combine(t["flow.w_cond"], t["flow.w_text"], t["flow.w_img"], 4.0, 2.0, renorm)
        assert rel_err(got, t[f"flow.w.{renorm}"]) < 1e-6, renorm
        outs[renorm] = got
    unnormed = t["flow.w_img"] + 2.0 * (t["flow.w_text"] + 4.0 * (t["flow.w_cond"] - t["flow.w_text"]) - t["flow.w_img"])
    for a, b in (("global", "channel"), ("channel", "text_channel")):
        assert rel_err(outs[a], outs[b]) > 1e-2, (a, b)
    assert rel_err(outs["global"], unnormed) > 1e-2


def _params(kw, height, width):
    return FlowParams(height, width, kw["num_timesteps"], kw["timestep_shift"], kw["cfg_text_scale"], kw["cfg_img_scale"],
                      tuple(kw["cfg_interval"]), kw["cfg_renorm_type"], kw["cfg_renorm_min"])


def check_image(res, t, name):
    assert rel_err(res.latent, t[f"{name}.latent"]) < TOL
    diff = (res.pixels.int() - t[f"{name}.pixels"].int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (diff.max(), (diff > 0).float().mean())


def max_tokens(s):
    """The reference's max_length counts the <|im_start|> decoding starts from."""
    return s["kw"]["max_think_token_n"] - 1


def generated(pipeline, res):
    """Our decoded ids as the reference lists them (it drops the <|im_end|> it stops at)."""
    ids = res.token_ids
    return ids[:-1] if ids and ids[-1] == pipeline.cfg.tokens.eos else ids


def test_understanding_matches(pipeline, reference):
    t, meta = reference
    s = meta["scenarios"]["understand"]
    res = pipeline.run("understand", s["prompt"], scenario_image(s["image"]), max_tokens=max_tokens(s))
    assert generated(pipeline, res) == s["token_ids"][1:]
    assert res.text == s["text"]


def test_text_to_image_matches(pipeline, reference):
    t, meta = reference
    s = meta["scenarios"]["t2i"]
    res = pipeline.run("text_to_image", s["prompt"], params=_params(s["kw"], *s["kw"]["image_shapes"]), seed=s["seed"])
    check_image(res, t, "t2i")


def test_edit_matches(pipeline, reference):
    t, meta = reference
    s = meta["scenarios"]["edit"]
    res = pipeline.run("edit", s["prompt"], scenario_image(s["image"]), params=_params(s["kw"], 0, 0), seed=s["seed"])
    assert res.pixels.shape == (64, 96, 3)  # the input fitted to the VAE's limits: H 64, W 96
    check_image(res, t, "edit")


def test_think_then_generate_matches(pipeline, reference):
    t, meta = reference
    s = meta["scenarios"]["think"]
    res = pipeline.run("text_to_image", s["prompt"], think=True, params=_params(s["kw"], *s["kw"]["image_shapes"]),
                       seed=s["seed"], max_tokens=max_tokens(s))
    assert generated(pipeline, res) == s["token_ids"][1:]
    assert res.think == s["text"]
    check_image(res, t, "think")


@pytest.mark.parametrize("renorm", ["global", "channel", "text_channel"])
def test_cfg_is_off_outside_the_interval(renorm):
    p = dataclasses.replace(FlowParams(16, 16), interval=(0.4, 1.0), renorm=renorm)
    assert p.scales(0.4) == (1.0, 1.0) and p.scales(0.41) == (4.0, 1.0) and p.scales(1.0) == (4.0, 1.0)
