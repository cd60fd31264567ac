"""Plugins whose function table is malformed (issue 17, item 6): a NULL
required entry or a NULL name crashed the process at import or at the first
op. Each is built here with the system C compiler, loaded from
TENSOR_OPS_PLUGIN_PATH in a fresh interpreter, and must be listed unusable
with the reason while CPU ops still run."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

INCLUDE = pathlib.Path(__file__).resolve().parents[2] / "cpp" / "include"

# Every entry of the table's C source; the test NULLs one of them.
PLUGIN_SOURCE = r"""
#include <string.h>
#include "tensor_ops/plugin.h"

static to_status init(char* r, size_t n) { (void)r; (void)n; return TO_OK; }
static int32_t priority(void) { return 1; }
static int32_t device_count(void) { return 1; }
static to_status device_info(int32_t d, to_device_info* o) { (void)d; memset(o, 0, sizeof *o); return TO_OK; }
static to_status mem_info(int32_t d, uint64_t* f, uint64_t* t) { (void)d; *f = *t = 1u << 20; return TO_OK; }
static to_status allocate(int32_t d, size_t b, void** p) { (void)d; (void)b; *p = 0; return TO_ERR_OUT_OF_MEMORY; }
static void deallocate(int32_t d, void* p, size_t b) { (void)d; (void)p; (void)b; }
static to_status copy(int32_t d, void* dst, uint64_t doff, const void* src, uint64_t soff, size_t b, int32_t k) {
  (void)d; (void)k; memcpy((char*)dst + doff, (const char*)src + soff, b); return TO_OK;
}
static to_status mset(int32_t d, void* p, uint64_t off, int32_t v, size_t b) { (void)d; memset((char*)p + off, v, b); return TO_OK; }
static to_status synchronize(int32_t d) { (void)d; return TO_OK; }
static const char* last_error(void) { return ""; }

const to_backend_v1* tensor_ops_backend_v1(void) {
  static to_backend_v1 t;
  t.abi_version = TENSOR_OPS_PLUGIN_ABI_VERSION;
  t.name = PLUGIN_NAME;
  t.init = init;
  t.priority = priority;
  t.device_count = device_count;
  t.device_info = device_info;
  t.mem_info = mem_info;
  t.allocate = allocate;
  t.deallocate = deallocate;
  t.copy = copy;
  t.memset = mset;
  t.synchronize = synchronize;
  t.last_error = last_error;
  t.NULL_ENTRY = 0;
  return &t;
}
"""

CHECK = r"""
import json
import numpy as np
import tensor_ops
rows = [{"name": b.name, "usable": b.usable, "reason": b.reason, "library": b.library} for b in tensor_ops.backends()]
x = np.array([-1.0, 0.0, 2.0], np.float32)
ok = bool(np.allclose(tensor_ops.silu(x), x / (1 + np.exp(-x.astype(np.float64))), rtol=1e-5))
print(json.dumps({"rows": rows, "cpu_op": ok}))
"""


def _compiler():
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


@pytest.mark.parametrize("entry", ["name", "init", "priority", "device_count", "device_info", "mem_info",
                                   "allocate", "deallocate", "copy", "memset", "synchronize", "last_error"])
def test_null_table_entry_is_listed_unusable_and_cpu_still_runs(tmp_path, entry):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc, clang) to build the malformed plugin")
    src = tmp_path / "plugin.c"
    src.write_text(PLUGIN_SOURCE)
    lib = tmp_path / "libtensor_ops_badtable.so"
    build = subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src), f"-I{INCLUDE}",
                            '-DPLUGIN_NAME="badtable"', f"-DNULL_ENTRY={entry}"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    env = {**os.environ, "TENSOR_OPS_PLUGIN_PATH": str(tmp_path), "TENSOR_OPS_BACKEND": "cpu"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, f"import crashed with a NULL '{entry}' (rc {r.returncode}):\n{r.stderr}"
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["cpu_op"]
    rows = [row for row in result["rows"] if row["name"] == "badtable"]
    assert len(rows) == 1, result["rows"]
    row = rows[0]
    assert not row["usable"]
    assert f"plugin table from {lib} has NULL '{entry}'" in row["reason"], row["reason"]
    assert row["library"] == str(lib)
