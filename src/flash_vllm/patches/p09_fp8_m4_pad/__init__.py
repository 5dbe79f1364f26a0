"""Patch 9: M%4 padding for sm_12x blockwise-fp8 GEMMs. Upstream in every supported release.

No code ships. The C++ fix (vllm#52775: misaligned-M GEMMs no longer routed to the small-M
swapAB config) is compiled into `_C.abi3.so` and cannot be seen from Python; the Python half
(vllm#49932: `BlockWiseTorchFP8ScaledMMLinearKernel.apply_block_scaled_mm` pads A to M%4 == 0)
can, and `upstream_check` reads it from the installed release. `PAD_M4` in the settings table is
accepted for compatibility and does nothing.
"""

from flash_common import releases

from ...registry import Context, Gate, Patch, expect_source

TARGET = ("vllm.model_executor.kernels.linear.scaled_mm.pytorch",
          "BlockWiseTorchFP8ScaledMMLinearKernel.apply_block_scaled_mm")


def upstream_check(ctx: Context) -> None:
    expect_source(*TARGET, "pad = (-M) % 4")


PATCH = Patch(
    number=9,
    name="fp8-m4-pad",
    title="M%4 padding for blockwise-fp8 GEMM (sm_12x)",
    why=("Misaligned M (M % 4 != 0) sent sm_12x blockwise-fp8 GEMMs to a config that failed. "
         "Fixed upstream before qwen4_exp shipped; documented here, no dead code."),
    upstream="vllm#52775 (C++ dispatch, in 0.29.0), vllm#49932 (Python M%4 pad)",
    gate=Gate.always("nothing to gate"),
    targets=(":".join(TARGET),),
    upstream_in=releases.upstream_from("0.29.0"),
    upstream_check=upstream_check,
)
