"""teo: this package's CPU-offload engine, saved-tensor hooks on TE's marks.

``te_offload_ops.engines.offload_context("teo", num_layers=n, model_layers=L)`` returns ``(context,
sync, counter)``, used as TE's pair is. Its parts:

* :mod:`.plan`: what to move (V2's rule on the policy's marks, V2's layout rules);
* :mod:`.schedule`: when, the layer schedule (default), and :mod:`.budget`: the memory budget,
  two strategies behind one interface; :mod:`.allocator_room`: what the caching allocator can
  serve without releasing its cache, for the budget;
* :mod:`.copies`: each range's trip to the host and back, a state machine;
* :mod:`.pool`: pinned host buffers reused from step to step;
* :mod:`.region`: when the backward of what ran in a layer's context is over;
* :mod:`.engine`: the hooks that tie them together; :mod:`.context`: the pair TE's users hold.
"""

from .budget import BudgetSchedule, target_budget
from .context import TeoContext, make_teo_context
from .engine import TeoEngine
from .pool import PinnedBufferPool, default_pool, free_pinned_buffers
from .schedule import LayerSchedule

__all__ = ["BudgetSchedule", "LayerSchedule", "PinnedBufferPool", "TeoContext", "TeoEngine", "default_pool",
           "free_pinned_buffers", "make_teo_context", "target_budget"]
