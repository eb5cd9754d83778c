"""What the gateway observes: engines' own metrics, and latency as callers feel it."""
