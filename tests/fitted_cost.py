"""A forward cost fitted from steps of known cost, for the planner's and the cost model's tests
(``test_draft_planner``, ``test_forward_cost``)."""

from edgespec.engine.draft_planner import ForwardCost


def fitted(fixed: float, per_token: float, per_row: float = 0.0,
           shapes=((1, 1), (2, 1), (1, 5), (4, 3), (3, 9), (2, 6))) -> ForwardCost:
    """A cost fitted on forwards of (rows, width) that took fixed + per_row * rows + per_token *
    rows * width seconds."""
    cost = ForwardCost()
    for _ in range(20):
        for rows, width in shapes:
            cost.observe(rows, width, fixed + per_row * rows + per_token * rows * width)
    return cost
