"""Every write to releases, jobs, gate results, approvals and deployments, one
module per domain (as Zulip's zerver/actions/): import from the module that owns
the write. The release state machine is in transitions.py."""
