"""flashcp: FlashCP's heuristic sharding, one module per pass.

- ``ranks``: the layout under construction;
- ``place``: the balanced pass (whole docs, zigzag of the docs no rank can hold, spill);
- ``nested``: nested zigzag cuts of a doc no rank can hold whole;
- ``refine``: token-neutral local search (``exchange`` for balance, ``descend`` for KV);
- ``paper``: Algorithm 1 as published (strategy ``flashcp_paper``, and the fallback);
- ``solve``: the passes, the objective of the request's exchange, the entry points.
"""

from planner_service.solvers.flashcp.paper import algorithm1, paper_layout
from planner_service.solvers.flashcp.solve import flashcp_layout, flashcp_shards

__all__ = ["algorithm1", "flashcp_layout", "flashcp_shards", "paper_layout"]
