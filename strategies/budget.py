"""The one exception for a spent privacy budget, on either side: the server's next central-DP
release (strategies/central_dp.py) or a node's next DP-SGD step (app/privacy/accounting.py)
would take ε past what the configuration allows, so it is not made.

Dependency-free: the ClientApp imports it without the server's strategies.
"""


class PrivacyBudgetExhausted(RuntimeError):
    """The next release (central DP) or DP-SGD step (local DP, or a node's plan done) would take
    ε past the budget; it was not made."""
