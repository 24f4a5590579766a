"""Validate and read local checkpoints (found by ``mstar.models.hub``, which also says where
repo ids are looked up). LLM directories hold `config.json`, weights as `model.safetensors` or
shards listed in `model.safetensors.index.json`, and `tokenizer.json`. Every error names the
file, and the tensor where there is one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mstar.models.hub import CheckpointError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class CheckpointFiles:
    directory: Path
    config: dict[str, Any]
    weight_map: dict[str, Path] = field(repr=False)  # tensor name -> file that holds it
    tokenizer: Path | None

    @property
    def weight_files(self) -> tuple[Path, ...]:
        return tuple(sorted(set(self.weight_map.values())))


def open_checkpoint(directory: str | Path, *, require_tokenizer: bool = True) -> CheckpointFiles:
    """Read `config.json` and the weight layout (single file or sharded index) of a directory."""
    directory = Path(directory)
    config = read_json(directory / "config.json")
    index_path, single = directory / INDEX_FILE, directory / SINGLE_FILE
    if index_path.is_file():
        index = read_json(index_path).get("weight_map")
        if not isinstance(index, dict) or not index:
            raise CheckpointError(f"{index_path}: no 'weight_map' of tensor name -> shard file")
        weight_map = {name: directory / shard for name, shard in index.items()}
    elif single.is_file():
        weight_map = {}
    else:
        raise CheckpointError(f"{directory}: missing weights, neither {SINGLE_FILE} nor {INDEX_FILE}")
    for shard in sorted(set(weight_map.values())):
        if not shard.is_file():
            raise CheckpointError(f"{index_path}: lists shard {shard.name} but {shard} is missing")
        present = _tensor_names(shard)
        absent = sorted(n for n, s in weight_map.items() if s == shard and n not in present)
        if absent:
            raise CheckpointError(f"{shard}: missing tensor {absent[0]!r} (listed in {INDEX_FILE})")
    if not weight_map:
        weight_map = dict.fromkeys(_tensor_names(single), single)
    tokenizer = directory / TOKENIZER_FILE
    if require_tokenizer and not tokenizer.is_file():
        raise CheckpointError(f"missing file {tokenizer}")
    return CheckpointFiles(directory, config, weight_map, tokenizer if tokenizer.is_file() else None)


def _tensor_names(path: Path) -> set[str]:
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return set(f.keys())
    except Exception as exc:  # safetensors raises its own error type on a truncated or foreign file
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); download it again") from None


def tensor_shapes(files: CheckpointFiles) -> dict[str, tuple[int, ...]]:
    """Shapes from the safetensors headers; no tensor data is read."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for shard in files.weight_files:
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                if files.weight_map.get(name) == shard:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def validate_shapes(files: CheckpointFiles, expected: Mapping[str, tuple[int, ...]], *, allow_extra: bool = False) -> None:
    """Raise CheckpointError naming the file and tensor on a missing, misshapen or extra tensor."""
    shapes = tensor_shapes(files)
    where = files.weight_files[0] if len(files.weight_files) == 1 else files.directory / INDEX_FILE
    for name, want in expected.items():
        if name not in shapes:
            raise CheckpointError(f"{where}: missing tensor {name!r} (expected shape {tuple(want)})")
        if shapes[name] != tuple(want):
            raise CheckpointError(
                f"{files.weight_map[name]}: tensor {name!r} has shape {shapes[name]}, expected {tuple(want)}"
            )
    extra = sorted(set(shapes) - set(expected))
    if extra and not allow_extra:
        raise CheckpointError(f"{files.weight_map[extra[0]]}: unexpected tensor {extra[0]!r} ({len(extra)} extra)")


def load_tensors(files: CheckpointFiles, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    wanted = list(files.weight_map) if names is None else list(names)
    for name in wanted:
        if name not in files.weight_map:
            raise CheckpointError(f"{files.directory}: missing tensor {name!r}")
    out: dict[str, torch.Tensor] = {}
    for shard in files.weight_files:
        with safe_open(shard, "pt") as f:
            for name in (n for n in wanted if files.weight_map[n] == shard):
                out[name] = f.get_tensor(name)
    return out


def load_tokenizer(files: CheckpointFiles) -> Tokenizer:
    """The `tokenizers.Tokenizer` of the checkpoint's tokenizer.json."""
    from tokenizers import Tokenizer

    if files.tokenizer is None:
        raise CheckpointError(f"missing file {files.directory / TOKENIZER_FILE}")
    try:
        return Tokenizer.from_file(str(files.tokenizer))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"{files.tokenizer}: cannot load tokenizer ({exc})") from None


def llama_tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a `LlamaForCausalLM` checkpoint (Orpheus is Llama-3.2-3B)."""
    try:
        hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
        inter, layers = int(config["intermediate_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
    except KeyError as exc:
        raise CheckpointError(f"config.json: missing key {exc.args[0]!r} for a Llama checkpoint") from None
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes
