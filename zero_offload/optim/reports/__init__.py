"""What the optimizer shows of itself: the live ``opt.state`` mapping and the placement
report."""
