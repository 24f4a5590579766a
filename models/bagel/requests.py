"""What a request builds before it generates: the context blocks of the three CFG contexts, in
order, as the reference's interleaved inference builds them.

Contexts (labelled caches of the LLM): ``main`` (everything), ``cfg_text`` (without the prompt
text: the text-unconditional branch) and ``cfg_img`` (without the input image: the
image-unconditional branch). A block is a causal text block (``<|im_start|> text <|im_end|>`` at
consecutive positions) or a non-causal image block (``<|vision_start|> tokens <|vision_end|>``, all
at one position) and goes into one or more contexts. A context no branch reads is never built.

- text-to-image: prompt -> main, cfg_img (cfg_text stays empty)
- editing: VAE block, ViT block -> main, cfg_text; prompt -> main, cfg_img
- understanding: ViT block (when there is an image), prompt -> main; then greedy decoding
- think mode: a system prompt first (into every context for generation), then after the prompt a
  greedy decode of the plan, whose text is appended to main as its own text block (the decoded
  tokens' K/V are dropped first, as the reference decodes on a copy of the context)
"""

from __future__ import annotations

from dataclasses import dataclass

MAIN, CFG_TEXT, CFG_IMG = "main", "cfg_text", "cfg_img"
LABELS = (MAIN, CFG_TEXT, CFG_IMG)
MODES = ("text_to_image", "edit", "understand")

VLM_THINK = ("You should first think about the reasoning process in the mind and then provide the user with the answer. \n"
             "The reasoning process is enclosed within <think> </think> tags, i.e. <think> reasoning process here </think> "
             "answer here")
GEN_THINK = ("You should first think about the planning process in the mind and then generate the image. \n"
             "The planning process is enclosed within <think> </think> tags, i.e. <think> planning process here </think> "
             "image here")


@dataclass(frozen=True)
class Block:
    # "text" | "vae" | "vit" | "think" (decode, then the text goes into main) | "decode" | "export" (the
    # contexts to the generating group) | "generate"
    kind: str
    labels: tuple[str, ...] = (MAIN,)
    text: str = ""  # for "text" blocks


def plan(mode: str, think: bool, cfg_text: float, cfg_img: float, prompt: str, image: bool = True) -> list[Block]:
    """The blocks of one request, in order, ending with its output step (``image``: understanding has
    an input image; without one it answers the text alone)."""
    if mode == "understand":
        blocks = [Block("text", (MAIN,), VLM_THINK)] if think else []
        return [*blocks, *([Block("vit")] if image else []), Block("text", (MAIN,), prompt), Block("decode")]
    keep = {MAIN, *((CFG_TEXT,) if cfg_text > 1.0 else ()), *((CFG_IMG,) if cfg_img > 1.0 else ())}

    def into(*labels: str) -> tuple[str, ...]:
        return tuple(label for label in LABELS if label in labels and label in keep)

    blocks = [Block("text", into(MAIN, CFG_TEXT, CFG_IMG), GEN_THINK)] if think else []
    if mode == "edit":
        blocks += [Block("vae", into(MAIN, CFG_TEXT)), Block("vit", into(MAIN, CFG_TEXT))]
    blocks.append(Block("text", into(MAIN, CFG_IMG), prompt))
    if think:
        blocks.append(Block("think"))
    labels = tuple(sorted(keep, key=LABELS.index))
    return [*blocks, Block("export", labels), Block("generate", labels)]


def think_text(decoded: str) -> str:
    """The reference's cut of a decoded reply (decoding starts after an <|im_start|>): up to the
    first <|im_end|>, and before any further <|im_start|>."""
    return decoded.split("<|im_end|>")[0].split("<|im_start|>")[0]
