"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) into
the rows of the model's fused projections.

PEFT stores, per adapted linear ``W`` [out, in], ``lora_A`` [r, in] and ``lora_B`` [out, r];
the adapted layer computes ``W x + B (A x) * s`` with ``s = lora_alpha / r`` (``/ sqrt(r)``
with ``use_rslora``; ``alpha_pattern`` / ``rank_pattern`` per module). Our decoder fuses
q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, so an adapter is turned into, per
fused module, one pair ``A`` [n, in] and ``B`` [n, out] (``n`` = the rows of every adapted
shard, stacked): shard ``j``'s rows of ``B`` are zero outside that shard's output rows, and
``s`` is folded into ``B``. Then one product ``(x A^T) B`` serves the whole fused projection.

Refused with a ``ValueError`` naming the file: DoRA, bias training, ``modules_to_save``,
adapted modules other than q/k/v/o/gate/up/down projections (embeddings, the head), ranks
above ``--max-lora-rank``, shapes that do not fit the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncengine.executor.models.layers import FUSED_SHARDS

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: The projections an adapter may adapt (our fused name for each).
TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
           "o_proj": "o_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
           "down_proj": "down_proj", "qkv_proj": "qkv_proj", "gate_up_proj": "gate_up_proj"}
#: Shards per fused module: the slot tables are this many times --max-lora-rank wide.
SHARDS = {"qkv_proj": 3, "gate_up_proj": 2, "o_proj": 1, "down_proj": 1}
_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoRAWeights:
    """One adapter in the model's layout: per fused module name (``model.layers.3.self_attn.
    qkv_proj``), ``(A [n, in], B [n, out], span [n, 2])``, A and B float32 on the CPU (scale
    folded into B), ``span[r]`` the output columns where row ``r`` of B may be non-zero (its
    shard's rows of a fused projection: the kernel reads only those)."""

    modules: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    rank: int

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b, _ in self.modules.values())


def adapter_files(path: str) -> tuple[Path, Path]:
    """(config, weights) of the adapter directory ``path``; ValueError when missing."""
    root = Path(path).expanduser()
    config = root / CONFIG_FILE
    if not config.is_file():
        raise ValueError(f"LoRA adapter {path!r}: no {CONFIG_FILE} there")
    for name in WEIGHT_FILES:
        if (root / name).is_file():
            return config, root / name
    raise ValueError(f"LoRA adapter {path!r}: no adapter_model.safetensors there")


def adapter_digest(path: str) -> bytes:
    """The adapter's identity: sha256 of its config and weights (the prefix cache's key, so
    that two names for the same files share cached blocks, and a name reloaded with other
    weights does not)."""
    h = hashlib.sha256(b"asyncengine-lora\0")
    for f in adapter_files(path):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.digest()


def read_config(path: str) -> dict[str, Any]:
    config_file, _ = adapter_files(path)
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type} is not LORA")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {path!r}: DoRA adapters are not supported")
    if config.get("bias", "none") not in ("none", None):
        raise ValueError(f"LoRA adapter {path!r}: trained biases (bias="
                         f"{config.get('bias')!r}) are not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {path!r}: modules_to_save "
                         f"({config['modules_to_save']}) is not supported")
    return config


def _pattern_value(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: the first key matching the module name's
    end, else ``default``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_tensors(weights: Path) -> dict[str, torch.Tensor]:
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(weights))
    return torch.load(str(weights), map_location="cpu", weights_only=True)


def load_adapter(path: str, model: Any, max_rank: int,
                 renames: tuple[tuple[str, str], ...] = ()) -> LoRAWeights:
    """The adapter at ``path`` laid out for ``model`` (its fused modules' ``shard_rows``)."""
    config = read_config(path)
    _, weights_file = adapter_files(path)
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {path!r}: fan_in_fan_out (Conv1D layers) is not "
                         "supported")
    tensors = _read_tensors(weights_file)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key} is not a LoRA A/B weight "
                             "(only q/k/v/o/gate/up/down projections may be adapted)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
    parts: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for name, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {name} has lora_{next(iter(ab))} alone")
        for old, new in renames:
            name = name.replace(old, new)
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in TARGETS or ".layers." not in f".{name}":
            raise ValueError(f"LoRA adapter {path!r}: module {name} cannot be adapted (only "
                             f"{', '.join(sorted(set(TARGETS) - {'qkv_proj', 'gate_up_proj'}))}"
                             " of the decoder layers)")
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(f"LoRA adapter {path!r}: {name} has lora_A {tuple(a.shape)} and "
                             f"lora_B {tuple(b.shape)}, which do not pair")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: rank {r} of {name} exceeds "
                             f"--max-lora-rank {max_rank}")
        rank = max(rank, r)
        a_alpha = float(_pattern_value(config.get("alpha_pattern"), name, alpha))
        scale = a_alpha / math.sqrt(r) if rslora else a_alpha / r
        fused = name[: -len(leaf)] + TARGETS[leaf]
        try:
            module = model.get_submodule(fused)
        except AttributeError:
            raise ValueError(f"LoRA adapter {path!r}: the model has no module {fused} (for "
                             f"{name}; a mixture-of-experts MLP cannot be adapted)") from None
        in_f, out_f = dims(module)
        if leaf in FUSED_SHARDS:
            parent = model.get_submodule(fused.rsplit(".", 1)[0])
            start, size = parent.shard_rows(FUSED_SHARDS[leaf][1])
        else:
            start, size = 0, out_f
        if a.shape[1] != in_f or b.shape[0] != size:
            raise ValueError(f"LoRA adapter {path!r}: {name} maps {a.shape[1]} -> {b.shape[0]}, "
                             f"the model's {leaf} maps {in_f} -> {size}")
        parts.setdefault(fused, []).append((start, size, a, b * scale))
    if not parts:
        raise ValueError(f"LoRA adapter {path!r}: no LoRA weights in {weights_file.name}")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for fused, shards in parts.items():
        in_f, out_f = dims(model.get_submodule(fused))
        n = sum(a.shape[0] for _, _, a, _ in shards)
        A, B = torch.zeros(n, in_f), torch.zeros(n, out_f)
        span = torch.zeros(n, 2, dtype=torch.int64)
        row = 0
        for start, size, a, b in shards:
            r = a.shape[0]
            A[row:row + r] = a
            B[row:row + r, start:start + size] = b.T
            span[row:row + r] = torch.tensor([start, start + size])
            row += r
        modules[fused] = (A.contiguous(), B.contiguous(), span)
    return LoRAWeights(modules, rank)


def dims(module: Any) -> tuple[int, int]:
    """(in, out) features of a linear layer, float or packed."""
    if hasattr(module, "in_features"):
        return int(module.in_features), int(module.out_features)
    out_f, in_f = module.weight.shape
    return int(in_f), int(out_f)
