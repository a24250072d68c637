"""From sensitivities to a plan: PaddleSlim's target_loss rule, budget allocation (knapsack), measured plans, joint
verification with BatchNorm re-estimation, export."""
