"""The planner service: HTTP (FastAPI) and gRPC edges over one PlannerService.

Modules: settings (PLANNER_* environment), schemas (wire types), ops (the operations),
executor (process pool, bounded queue, deadlines, cache), jobs (one-batch-ahead store),
metrics (Prometheus), http_app / middleware, grpc_server / grpc_wire, server (both in one
process), fcp_bridge (the FCP entry point). Nothing here is imported by the core.
"""
