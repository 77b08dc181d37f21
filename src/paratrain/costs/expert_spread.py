"""How many expert-parallel ranks one token's k experts reach: the rows --ep sends per token
(parallel/ep/ep_exchange.py sends a token once to each rank holding any of its experts).

Routing patterns the planner prices:
  random       each token's k distinct experts drawn uniformly (a trained, balanced router; the default):
               r = ep * (1 - C(E - E/ep, k) / C(E, k)), the expected number of ranks hit
  consecutive  token t takes experts t*k .. t*k + k - 1 (mod E): NeMo AutoModel's balanced benchmark gate
               (`fake_balanced_gate`), which published MoE throughputs use; r is its mean over the tokens
Experts are split over the ep ranks in order (rank i holds experts i*E/ep .. (i+1)*E/ep - 1), as apply_ep does.
"""

from __future__ import annotations

import math

from paratrain.errors import UserError

ROUTINGS = ("random", "consecutive")


def ranks_per_token(n_experts: int, top_k: int, ep: int, routing: str = "random") -> float:
    if ep <= 1 or n_experts <= 0 or top_k <= 0:
        return 1.0
    local = n_experts // ep
    k = min(top_k, n_experts)
    if routing == "random":
        return ep * (1.0 - math.comb(n_experts - local, k) / math.comb(n_experts, k))
    if routing == "consecutive":
        period = n_experts // math.gcd(n_experts, k)
        hit = [len({((t * k + j) % n_experts) // local for j in range(k)}) for t in range(period)]
        return sum(hit) / period
    raise UserError(f"unknown MoE routing {routing!r}; known: {', '.join(ROUTINGS)}")
