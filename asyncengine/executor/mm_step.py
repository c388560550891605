"""Images in a step: which placeholder positions of the step's tokens take which slice of
which image's encoder output (``prepare``, on the loop), and the forward pass that splices
them into the input embeddings (``execute``, on the device).

Only steps that compute some image placeholder pay anything: the runner keeps the requests
whose placeholders are not all computed yet (``pending``), and a step whose tokens meet none
of them carries no ``mm`` and runs its path as any text step does. A step that does runs the
per-layer decoder with the spliced embeddings (image rows are prompt rows: prefill and mixed
steps, never decode-only ones in practice). The encoder runs once per image while its output
stays in the :class:`~asyncengine.executor.models.vision.encoder_cache.EncoderCache`; chunks
that split an image's placeholders read slices of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.core.multimodal import MMInput
from asyncengine.core.request import Request
from asyncengine.executor.attention.image_spans import ImageSpanAttention
from asyncengine.executor.paths.base import begin


@dataclass
class MMSlice:
    """Step tokens ``[flat, flat + hi - lo)`` take rows ``[lo, hi)`` of ``item``'s output."""

    flat: int
    item: MMInput
    lo: int
    hi: int
    # An image attended both ways (``item.whole``): its request's blocks up to its end.
    blocks: Any = None


def step_slices(scheduled: list[Any], pending: dict[str, Request], batch: Any,
                block_size: int) -> list[MMSlice]:
    """The image slices of a step (``scheduled``: its ``ScheduledRequest``s, in order);
    requests whose last placeholder this step computes leave ``pending``."""
    slices: list[MMSlice] = []
    flat = 0
    for s in scheduled:
        req = s.request
        n = s.num_new_tokens
        drafts = s.spec_token_ids
        width = len(drafts) + 1 if drafts else n
        if req.request_id in pending and not drafts:
            start, end = s.start, s.start + n
            for item in req.mm_inputs or ():
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo < hi:
                    blocks = None
                    if item.whole:  # (a copy: the row may be reused while the step runs)
                        row = batch.row_of[req.request_id]
                        n = -(-hi // block_size)
                        blocks = torch.from_numpy(batch.block_table[row, :n].copy())
                    slices.append(MMSlice(flat + lo - start, item, lo - item.offset,
                                          hi - item.offset, blocks))
            if end >= max(item.end for item in req.mm_inputs or ()):
                del pending[req.request_id]
        flat += width
    return slices


def encoder_outputs(model: Any, cache: Any, slices: list[MMSlice], device: torch.device,
                    plan: Any = None) -> dict[bytes, torch.Tensor]:
    """Each image run's encoder output ``[tokens, hidden]``: from the cache, or encoded now
    (the missing ones of the step at once: ``ImageEncoder.encode_many``). ``plan`` (the
    step's ``core.encoder_budget.EncoderPlan``) drops outputs from the cache first and says
    which new ones it keeps: the runner encodes what the budget counted, nothing more."""
    if plan is not None and cache is not None:
        cache.drop(plan.evict)
    outs: dict[bytes, torch.Tensor] = {}
    missing: dict[bytes, MMInput] = {}
    for s in slices:
        key = s.item.hash
        if key in outs or key in missing:
            continue
        hit = cache.get(key) if cache is not None else None
        if hit is not None:
            outs[key] = hit
        else:
            missing[key] = s.item
    if missing:
        items = list(missing.values())
        encoded = model.vision.encode_many([it.data for it in items], device)
        for it, out in zip(items, encoded, strict=True):
            outs[it.hash] = out
            if cache is not None and (plan is None or it.hash in plan.keep):
                cache.put(it.hash, out)
    return outs


def forward_with_images(runner: Any, inputs: Any, last_sampled: torch.Tensor | None
                        ) -> torch.Tensor:
    """The step's final hidden states, image placeholders' embeddings replaced by the
    encoder's output (the per-layer decoder: ``paths/eager.py`` with embeddings)."""
    begin(inputs, last_sampled, runner.attn_backend)
    model = runner.model
    h = model.embed(inputs.input_ids)
    outs = encoder_outputs(model, runner.encoder_cache, inputs.mm, h.device, inputs.mm_plan)
    width = h.shape[1]
    for s in inputs.mm:
        h[s.flat:s.flat + s.hi - s.lo] = outs[s.item.hash][s.lo:s.hi, :width].to(h.dtype)
    backend = runner.attn_backend
    whole = [s for s in inputs.mm if s.blocks is not None]
    if whole:
        backend = ImageSpanAttention(backend, whole)
    kw = {}
    k = getattr(model.vision, "deepstack", 0)
    if k:  # Qwen3-VL: each row's deepstack features, for the first k layers
        rows = torch.cat([torch.arange(s.flat, s.flat + s.hi - s.lo) for s in inputs.mm])
        feats = torch.cat([outs[s.item.hash][s.lo:s.hi, width:] for s in inputs.mm])
        kw["deepstack"] = (rows.to(h.device), feats.view(-1, k, width).transpose(0, 1))
    return model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn_metadata,
                 backend, inputs_embeds=h, **kw)
