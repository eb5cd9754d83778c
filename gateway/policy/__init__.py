"""The policy SREs edit: typed model and loader."""

from gateway.policy.loader import PolicyError, load_policy, parse_policy
from gateway.policy.model import BackendSpec, ModelSpec, Policy, PoolSpec

__all__ = ["BackendSpec", "ModelSpec", "Policy", "PolicyError", "PoolSpec", "load_policy",
           "parse_policy"]
