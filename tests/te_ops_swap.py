"""pytest plugin (``-p te_ops_swap``): TE's own tests run with TE's grouped-MLP ops replaced by this
package's, so TE's test suite checks them as drop-in ops.

Every ``te.ops.<name>`` in SWAPPED becomes ``te_offload_ops.<name>`` before TE's tests import; the
package's ops subclass TE's, so TE's fusions and isinstance checks still take them.
"""

import torch  # noqa: F401  (before transformer_engine)
import transformer_engine.pytorch as te

import te_offload_ops as teo

SWAPPED = ("GroupedLinear", "ScaledSReLU", "ScaledTanhSReLU", "ScaledSwiGLU", "ScaledSiTUGLU", "ScaledClampedQGeGLU")


def pytest_configure(config):
    for name in SWAPPED:
        setattr(te.ops, name, getattr(teo, name))
    config.addinivalue_line("markers", "te_ops_swapped: TE's ops replaced by te_offload_ops'")


def pytest_report_header(config):
    return "te_offload_ops: te.ops." + ", te.ops.".join(SWAPPED) + " replaced by this package's ops"
