"""`gateway plan`, the capacity planner (docs/planner.md).

- `capacity.py`: the memory ledger (weights, KV budget, concurrency per layout, the KV demand
  and its overflow odds from a trace), computed by the pure `plan()`;
- `plan.py`: the command line (`add_arguments`, `run`) and its text and JSON reports;
- `throughput.py`: the roofline: what each layout serves at the planned load;
- `token_price.py`: what those tokens cost, by the rule of `gateway/cost/pricing.py`.
"""
