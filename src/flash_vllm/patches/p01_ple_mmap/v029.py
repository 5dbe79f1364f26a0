"""Patch 1 on vLLM 0.29: the PLE table behind a splitting op of ours, rows from the mmapped checkpoint.

0.29 keeps the table in `nvidia/ple_layer.py`: `Qwen4ExpNGramEmbedding.__init__` builds a
`PLEVocabParallelEmbedding` (GPU-resident; fp8 only for an `Fp8Config` checkpoint, the model dtype
otherwise), and `forward` runs the splitting op `vllm::qwen4_exp_compute_ple_ngram_ids` (the ids)
followed by `F.embedding` inside the next piecewise CUDA graph. With the gate on:

- `ple_layer.PLEVocabParallelEmbedding` is a subclass built on the `meta` device (no table storage
  anywhere, whatever the quant method), whose `weight_loader` drops the `ngram_embedding.shard_<i>`
  rows the stock `load_weights` hands it. The table's dtype and scale come from the checkpoint
  headers (the PLE engine): the scale lives in a real persistent `weight_scale` buffer in the
  dtype 0.29's fp8 method declares (bf16), loaded from the checkpoint like the stock parameter,
  so the stock `Qwen4ExpPLELayer._dequantize_embeddings` dequantises exactly as 0.29 does
  (`rows.to(dtype) * weight_scale.to(dtype)`). This also covers ModelOpt checkpoints, where
  stock 0.29 would allocate a model-dtype table and drop the scale.
- `Qwen4ExpNGramEmbedding.forward` calls our op `vllm::flash_ple_mmap_lookup` instead: it computes
  the ids with the release's own `compute_ngram_ids`, gathers the raw rows through the PLE engine
  (`Stager.lookup(raw=True)`) into a persistent per-layer buffer and copies them into the op's
  output. The op is appended to `CompilationConfig._attention_ops` (0.29's splitting ops), so under
  PIECEWISE it runs eagerly between graph segments, like the ids op it replaces.
- The gather itself is the same guarded call as on 0.30+ (`guard.gather_into`): an eager break
  when breakable graphs are on, zeros during a breakable capture, a loud error inside a plain
  stream capture (a FULL graph, or splitting ops given without our op).

The run spec forces `cudagraph_mode=PIECEWISE` (0.29 captures uniform decode batches FULL by
default, where splitting ops split nothing) and leaves `splitting_ops` unset so 0.29 copies its
list, ours included.
"""

import inspect  # no `from __future__ import annotations`: the op schema is read from real annotations

from ...registry import TargetMissing, expect_installed, expect_source, install, original, resolve

LAYER = "vllm.models.qwen4_exp.nvidia.ple_layer"
STORAGE = (LAYER, "PLEVocabParallelEmbedding")
INIT = (LAYER, "Qwen4ExpNGramEmbedding.__init__")
FORWARD = (LAYER, "Qwen4ExpNGramEmbedding.forward")
LOAD = (LAYER, "Qwen4ExpNGramEmbedding.load_weights")
DEQUANT = (LAYER, "Qwen4ExpPLELayer._dequantize_embeddings")
SCALE = (LAYER, "Qwen4ExpPLELayer._get_embedding_weight_scale")
FP8_METHOD = (LAYER, "Qwen4ExpPLEFp8EmbeddingMethod.create_weights")
IDS_OP = (LAYER, "qwen4_exp_compute_ple_ngram_ids")
COMPILATION = "vllm.config.compilation"
SPLITTING = (COMPILATION, "CompilationConfig.set_splitting_ops_for_v1")
OP_NAME = "flash_ple_mmap_lookup"
SPLIT_OP = f"vllm::{OP_NAME}"
STOCK_SPLIT_OP = "vllm::qwen4_exp_compute_ple_ngram_ids"
TARGETS = (STORAGE, INIT, FORWARD, LOAD, DEQUANT, IDS_OP, SPLITTING)


def _attention_ops() -> list:
    from ...registry import import_target

    cc = import_target(COMPILATION).CompilationConfig
    ops = inspect.getattr_static(cc, "_attention_ops", None)
    if not isinstance(ops, list):
        raise TargetMissing(f"{COMPILATION}:CompilationConfig._attention_ops is no longer a list")
    return ops


def check() -> None:
    expect_source(*INIT, "PLEVocabParallelEmbedding(", "padded_vocab_size", 'prefix=f"{prefix}.ngram_embedding"',
                  "params_dtype=params_dtype")
    expect_source(*FORWARD, "torch.ops.vllm.qwen4_exp_compute_ple_ngram_ids(",
                  "self.ngram_embedding(ngram_ids).flatten(-2)")
    expect_source(*LOAD, "embedding.weight.weight_loader(", "checkpoint_start=checkpoint_start",
                  "AutoWeightsLoader(self)")
    expect_source(*DEQUANT, "is_fp8(embeddings)", "weight_scale.to(output_dtype)")
    expect_source(*SCALE, '"weight_scale"')
    expect_source(*FP8_METHOD, '"weight_scale"', "scale_dtype=torch.bfloat16")
    expect_source(*IDS_OP, "no_compile_layers[layer_name]", "layer.ple_embedding.compute_ngram_ids(")
    expect_source(*SPLITTING, "list(self._attention_ops)")
    expect_source("vllm.compilation.breakable_cudagraph", "eager_break_during_capture", "cudagraph_runtime_mode")
    _, _, storage = resolve(*STORAGE)
    if "checkpoint_start" not in inspect.signature(original(storage).weight_loader).parameters:
        raise TargetMissing(f"{LAYER}:PLEVocabParallelEmbedding.weight_loader takes no checkpoint_start")
    if not hasattr(resolve(LAYER, "Qwen4ExpNGramEmbedding")[2], "compute_ngram_ids"):
        raise TargetMissing(f"{LAYER}:Qwen4ExpNGramEmbedding has no compute_ngram_ids")
    if STOCK_SPLIT_OP not in _attention_ops():
        raise TargetMissing(f"CompilationConfig._attention_ops no longer lists {STOCK_SPLIT_OP}")


def apply() -> None:
    install(1, *STORAGE, make_storage)
    install(1, *FORWARD, make_forward)
    register_op()
    ops = _attention_ops()
    if SPLIT_OP not in ops:
        ops.append(SPLIT_OP)  # in place: set_splitting_ops_for_v1 copies the class list


def verify() -> None:
    expect_installed(1, *STORAGE)
    expect_installed(1, *FORWARD)
    import torch

    if not hasattr(torch.ops.vllm, OP_NAME):
        raise TargetMissing(f"patch 1: torch.ops.vllm.{OP_NAME} is not registered")
    if _attention_ops().count(SPLIT_OP) != 1:
        raise TargetMissing(f"patch 1: {SPLIT_OP} is not listed once in CompilationConfig._attention_ops")


# --- the op ----------------------------------------------------------------------------------

def register_op() -> None:
    import torch

    if hasattr(torch.ops.vllm, OP_NAME):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    def flash_ple_mmap_lookup(input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                              ngram_context: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
        """ids (the release's own hashing) -> rows of the mmapped table -> `output`, between graphs."""
        from vllm.forward_context import get_forward_context

        ngram = get_forward_context().no_compile_layers[layer_name].ple_embedding
        ids = ngram.compute_ngram_ids(input_ids, query_start_loc, ngram_context)
        ngram.ngram_embedding.flash_lookup(ids, output)

    def flash_ple_mmap_lookup_fake(input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                                   ngram_context: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
        return None

    direct_register_custom_op(op_name=OP_NAME, op_func=flash_ple_mmap_lookup, mutates_args=["output"],
                              fake_impl=flash_ple_mmap_lookup_fake)


# --- the replacements ---------------------------------------------------------------------------

def make_forward(orig):
    import torch

    def forward(self, input_ids, query_start_loc, ngram_context):
        table = self.ngram_embedding
        if not getattr(table, "flash_mmap", False):
            return orig(self, input_ids, query_start_loc, ngram_context)
        # Allocated in the graph like the stock ids tensor; our op fills it between segments.
        rows = input_ids.new_empty((input_ids.shape[0], self.ngram_heads, self.head_dim),
                                   dtype=table.flash_rows_dtype)
        torch.ops.vllm.flash_ple_mmap_lookup(input_ids, query_start_loc, ngram_context, rows, self.layer_name)
        rows = rows.flatten(-2)
        if table.flash_cast_to is not None:  # a non-fp8 table in another dtype: the stock load cast
            rows = rows.to(table.flash_cast_to)
        return rows

    return forward


def make_storage(upstream_cls):
    import torch
    from vllm.config import get_current_vllm_config

    from . import guard as ple_mmap

    class FlashMmapPLEVocabParallelEmbedding(upstream_cls):
        """0.29's PLE table, served from the checkpoint's mmapped shards by flash's PLE engine."""

        flash_mmap = True
        SCALE_DTYPE = torch.bfloat16  # Qwen4ExpPLEFp8EmbeddingMethod's weight_scale (checked)

        def __init__(self, num_embeddings, embedding_dim, *args, params_dtype=None, prefix="", **kwargs):
            with torch.device("meta"):  # every parameter the quant method creates: no storage
                super().__init__(num_embeddings, embedding_dim, *args, params_dtype=params_dtype,
                                 prefix=prefix, **kwargs)
            self._parameters.pop("weight_scale", None)  # the fp8 method's (meta) scale; ours below
            vcfg = get_current_vllm_config()
            model_path = getattr(getattr(vcfg, "model_config", None), "model", None)
            sched = getattr(vcfg, "scheduler_config", None)
            self._flash_layer = ple_mmap.layer_of(prefix)
            self._flash_model_path = model_path
            table = ple_mmap.TABLES.get(model_path, self._flash_layer)  # opened now: dtype, scale, rows
            if table.num_rows < self.org_vocab_size:
                raise ValueError(f"PLE table of layer {self._flash_layer} has {table.num_rows} rows; the model "
                                 f"expects {self.org_vocab_size}")
            if table.head_dim != embedding_dim:
                raise ValueError(f"PLE table of layer {self._flash_layer} has rows of {table.head_dim} values; "
                                 f"the model expects {embedding_dim}")
            if table.dtype == "NVFP4":
                raise ValueError("VLLM_PLE_MMAP on vLLM 0.29: this checkpoint's PLE table is NVFP4 (ModelOpt "
                                 "codes + block scales), which 0.29 has no table method for; serve it on 0.33+")
            if table.dtype == "F8_E5M2":
                raise ValueError("VLLM_PLE_MMAP on vLLM 0.29: the PLE layer dequantises float8_e4m3fn "
                                 "tables only; this checkpoint's table is F8_E5M2")
            from ...ple.stager import torch_dtype

            self.flash_rows_dtype = torch_dtype(table.dtype)
            fp8 = table.dtype == "F8_E4M3"
            self.flash_cast_to = None if fp8 or self.flash_rows_dtype == self.params_dtype else self.params_dtype
            if fp8 and table.scale is None:
                raise ValueError(f"PLE table of layer {self._flash_layer} is fp8 without a weight_scale")
            if table.scale is not None:
                # Real storage on the model's device; the checkpoint's value is loaded into it as
                # into the stock parameter (same rounding); the header's value until then.
                self.register_buffer("weight_scale", torch.tensor([table.scale], dtype=torch.float32)
                                     .to(self.SCALE_DTYPE), persistent=True)
            self._flash_rows = max(int(getattr(sched, "max_num_batched_tokens", 0) or 0), 1)
            self._flash_out = None
            self._flash_stager = None
            self._flash_gather = ple_mmap.eager_break(self._gather_into)

        def weight_loader(self, param, loaded_weight, checkpoint_start=None):
            if param is self.weight:
                return  # the rows are served from disk
            return super().weight_loader(param, loaded_weight, checkpoint_start=checkpoint_start)

        def stager(self, device):
            if self._flash_stager is None:
                from ...ple import Stager

                table = ple_mmap.TABLES.get(self._flash_model_path, self._flash_layer)
                self._flash_stager = Stager(table, device, stats=ple_mmap.TABLES.stats)
            return self._flash_stager

        def _gather_into(self, ngram_ids, out):
            ple_mmap.gather_into(self.stager, ngram_ids, out, raw=True)

        def flash_lookup(self, ngram_ids, output):
            """Rows of `ngram_ids` (N, heads) into `output` (N, heads, head_dim), via the
            persistent buffer (the Stager keys its small graphs on the destination address)."""
            n = ngram_ids.shape[0]
            out = self._flash_out
            if out is None or out.shape[0] < n or out.shape[1:-1] != ngram_ids.shape[1:] \
                    or out.device != ngram_ids.device:
                if ple_mmap._is_capturing(torch):
                    raise RuntimeError("mmap PLE output buffer must be allocated before graph capture")
                out = torch.empty(max(self._flash_rows, n), *ngram_ids.shape[1:], self.embedding_dim,
                                  dtype=self.flash_rows_dtype, device=ngram_ids.device)
                self._flash_out = out
            view = out[:n]
            self._flash_gather(ngram_ids, view)
            output.copy_(view)

        def forward(self, input_):  # nothing may read the (meta) table through the stock path
            raise RuntimeError("mmap PLE table: rows are served by vllm::flash_ple_mmap_lookup")

    FlashMmapPLEVocabParallelEmbedding.__qualname__ = "FlashMmapPLEVocabParallelEmbedding"
    return FlashMmapPLEVocabParallelEmbedding
