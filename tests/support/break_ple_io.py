"""pytest plugin for tests/unit/test_skip_rules.py: makes PLETable refuse the io modes named in
FLASH_BREAK_PLE_IO (comma separated), as a broken mmap or uring path would. The PLE tests must
then FAIL, not skip. Loaded with `-p break_ple_io` (tests/support on PYTHONPATH)."""

import os


def pytest_configure(config):
    from flash_vllm.ple import table

    broken = set(os.environ.get("FLASH_BREAK_PLE_IO", "").split(","))
    orig = table.PLETable.__init__

    def init(self, *a, config=None, **kw):
        io = getattr(config, "io", "auto")
        if io in broken:
            raise table.PLETableError(f"broken on purpose by break_ple_io: io={io}")
        return orig(self, *a, config=config, **kw)

    table.PLETable.__init__ = init
