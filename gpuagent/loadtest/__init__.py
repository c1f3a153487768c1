"""Load testing of an OpenAI-compatible endpoint (no Django): named workload
profiles (`profiles.toml`) under closed-loop sweeps and open-loop arrivals,
per-level latency/throughput/goodput, server memory from /metrics, and cost at the
highest load that meets the SLO. `run_load_test(...) -> LoadTestReport`; CLI
`python -m gpuagent.loadtest --endpoint URL --profile chat`. The agent's load_test
job runs a `gpuagent.protocol.LoadPlan` instead (`plan_runner.run_plan`): session
workloads, the knee search, context and rate sweeps, within a time budget."""

from gpuagent.loadtest.profiles import Profile, load_profiles
from gpuagent.loadtest.runner import Bounds, Costs
from gpuagent.loadtest.suite import LoadTestError, Plan, run_load_test

__all__ = [
    "Bounds",
    "Costs",
    "LoadTestError",
    "Plan",
    "Profile",
    "load_profiles",
    "run_load_test",
]
