"""The price table moved to ``workers/tools/cost.py`` (``ddiloco run`` and ``ddiloco log`` report
the estimate, and workers/ never imports infra/); this name is kept for older callers."""
from workers.tools.cost import (BYTES_PER_PARAM, DEFAULT_PRICES, DEFAULT_SOURCE, GB, MONTH_S,  # noqa: F401
                                CostEstimate, PriceTable, dp_allreduce_bytes, estimate_monthly_cost, load_prices,
                                parse_prices, prices_from_dict)
