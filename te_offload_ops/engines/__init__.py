"""CPU-offload engines behind one call: TE's V2 and V1, and this package's teo.

``offload_context(engine, num_layers=n, model_layers=L)`` returns ``(context, sync, counter)``;
``measure_budget(step, ...)`` measures, with your step, the memory budget teo should run under;
``target_budget(...)`` is that budget's arithmetic from figures you measured yourself.
"""

from .contexts import ENGINES, offload_context
from .counter import OffloadCounter
from .measure import BudgetAdvice, measure_budget
from .te_engines import active_engine
from .teo import free_pinned_buffers, target_budget

__all__ = ["ENGINES", "BudgetAdvice", "OffloadCounter", "active_engine", "free_pinned_buffers", "measure_budget",
           "offload_context", "target_budget"]
