"""Constants of the gather's page arithmetic, in a leaf module: `native.py` (numpy twins) and
`native_nb.py` (numba versions) both read them, and neither imports the other back."""

PAGE = 4096
SCRATCH = 2 * PAGE  # O_DIRECT scratch per row: a row spans at most two 4 KiB pages (rows <= 4 KiB)
