"""The multimodal encoder's part of vLLM's profile run, asked of the release on CPU.

vLLM's profile run (the V2 runner's `profile_run`, 0.33) first runs the vision tower on
`MultiModalBudget.get_dummy_encoder_profile_inputs()`: as many dummy items of the largest
modality as the encoder budget (max(BATCHED_TOKENS, the largest item)) holds, at most SEQS x the
items one prompt can hold. Its peak is part of the "peak activation" vLLM subtracts from the KV
budget. Here the release's own MultiModalBudget says how many items of how many tokens (from the
snapshot's own processor config), and the release's own `Qwen3_VisionTransformer` runs them on CPU
while every tensor an aten op returns is counted until it is freed: the peak of live tensor bytes.

What this cannot see: buffers inside fused kernels (CUDA's flash attention keeps none of size N^2),
the caching allocator's rounding, and the CUDA kernels' own choices where they differ from the CPU
ones. The pixels go in as the processor hands them over (raw uint8 on 0.33, whose device normalises
them: the release's own `build_mm_input_norm`); the tower's own `.to(device)` copies them inside the
counted region, as the upload is alive on the GPU through the whole encoder call.

Used by lab/encoder_peak.py; by hand, inside a release venv (tools/check_vllm_release.py):
  CUDA_VISIBLE_DEVICES= python tests/vllm/release/encoder_peak.py --model SNAPSHOT \
      [--batched-tokens 8192] [--seqs 8] [--max-model-len 8192] [--vision H,I,HEADS] [--depth 1] [--run]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import weakref
from pathlib import Path


def budget(model: str, batched: int, seqs: int, max_model_len: int):
    """(VllmConfig, MultiModalBudget) as the engine builds them for these settings."""
    from prefix_sim import _as_on_cuda
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    with _as_on_cuda():
        mc = ModelConfig(model=model, max_model_len=max_model_len, dtype="bfloat16")
        sched = SchedulerConfig(max_num_batched_tokens=batched, max_num_seqs=seqs, max_model_len=max_model_len,
                                enable_chunked_prefill=True, is_encoder_decoder=False)
        vc = VllmConfig(model_config=mc, scheduler_config=sched, parallel_config=ParallelConfig(),
                        device_config=DeviceConfig(device="cpu"))
        return vc, MultiModalBudget(vc, MULTIMODAL_REGISTRY, enable_cache=False)


class LiveBytes:
    """A dispatch mode that counts the storage bytes of every tensor an op returns, until the last
    tensor on that storage is freed; `peak` is the most alive at once, `at` the op that reached it."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.saw(out, str(func))
                return out

        self.mode = Mode()
        self.live: dict[int, list[int]] = {}
        self.cur = self.peak = 0
        self.at = ""

    def saw(self, out, op: str) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in self.live:
                self.live[ptr][1] += 1
            else:
                self.live[ptr] = [st.nbytes(), 1]
                self.cur += st.nbytes()
                if self.cur > self.peak:
                    self.peak, self.at = self.cur, op
            weakref.finalize(t, self._drop, ptr)

    def _drop(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[ptr]
            self.cur -= entry[0]


def dummy_grid(b, hf_vision) -> list[int]:
    """[t, h, w] in patches of the budget's dummy image, the largest the processor makes (its
    `get_image_size_with_most_features`); the processor itself is not run (the vllm tier's shim
    stands in for torchvision): its pixels are made at that shape."""
    size = b.processor.info.get_image_size_with_most_features()
    p = hf_vision.patch_size
    return [1, size.height // p, size.width // p]


def run_tower(vc, hf_vision, grid_one: list[int], n_items: int, depth: int,
              override: tuple[int, int, int] | None) -> dict:
    """The release's vision tower (random weights, `depth` blocks: activations are freed block by
    block, so one block reaches the peak of 27) on the dummy items, as `_process_image_input` feeds it."""
    import torch
    from gloo_world import single_process_world
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fusion.mm_input_norm import build_mm_input_norm
    from vllm.model_executor.models import qwen3_vl
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    qwen3_vl.HAS_TRITON = False  # the position-embedding interpolation's native twin (same output tensor)

    cfg = hf_vision.__class__.from_dict({**hf_vision.to_dict(), "depth": depth,
                                         **({"hidden_size": override[0], "intermediate_size": override[1],
                                             "num_heads": override[2]} if override else {})})
    t, h, w = grid_one
    per_patch = hf_vision.in_channels * hf_vision.temporal_patch_size * hf_vision.patch_size ** 2
    grid = [grid_one] * n_items
    # gloo's file store creates its file: a name inside a private new directory, not mktemp's race
    with tempfile.TemporaryDirectory() as store, set_current_vllm_config(vc), \
            single_process_world(Path(store) / "gloo"):
        torch.set_default_dtype(torch.bfloat16)
        norm = build_mm_input_norm(vc.model_config)  # 0.33: uint8 pixels, normalised on the device
        tower = Qwen3_VisionTransformer(cfg, norm_eps=1e-6, quant_config=None, input_norm=norm,
                                        prefix="visual").eval()
        torch.set_default_dtype(torch.float32)
        for mod in tower.modules():  # CPU linears dispatch through a per-layer hook set at weight loading
            if hasattr(mod, "quant_method"):
                mod.cpu_linear = torch.nn.functional.linear
        # what the processor hands over: raw uint8 where the device normalises (0.33's default,
        # mm_device_do_normalize), else float32; the items concatenated, as group_and_batch_mm_kwargs
        upload_dtype = getattr(tower.input_norm, "input_dtype", None) or torch.float32
        pixels = torch.randint(0, 256, (n_items * t * h * w, per_patch)).to(upload_dtype)
        live = LiveBytes()
        with torch.inference_mode():
            tower(pixels, grid)  # warm: first-call caches are not the profile's
            with live.mode:
                out = tower(pixels, grid)
    patches = int(pixels.shape[0])
    return {"patches": patches, "pixel_dtype": str(pixels.dtype).removeprefix("torch."),
            "vision": {"hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "heads": cfg.num_heads,
                       "depth_run": depth},
            "peak_bytes": live.peak, "peak_at": live.at, "upload_bytes": pixels.numel() * pixels.element_size(),
            "out_bytes": out.numel() * out.element_size(), "bytes_per_patch": round(live.peak / patches, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--vision", help="HIDDEN,INTERMEDIATE,HEADS instead of the snapshot's vision tower")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--run", action="store_true", help="run the tower (else only the budget)")
    a = ap.parse_args(argv)
    override = tuple(int(v) for v in a.vision.split(",")) if a.vision else None
    vc, b = budget(a.model, a.batched_tokens, a.seqs, a.max_model_len)
    modality = b.get_modality_with_max_tokens()
    hf_vision = vc.model_config.hf_config.vision_config
    row = {"batched_tokens": a.batched_tokens, "seqs": a.seqs, "max_model_len": a.max_model_len,
           "encoder_budget": b.get_encoder_budget(), "modality": modality,
           "tokens_per_item": b.mm_max_toks_per_item[modality], "items": b.mm_max_items_per_batch[modality],
           # the vision tower merges merge x merge patches into one token
           "patches_per_token": hf_vision.spatial_merge_size ** 2}
    if a.run:
        grid = dummy_grid(b, hf_vision)
        row |= {"grid": grid} | run_tower(vc, hf_vision, grid, row["items"], a.depth, override)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    raise SystemExit(main())
