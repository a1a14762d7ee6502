"""Where a gradient goes: the backward router and its hooks, each bucket's gradient
lifecycle (``GradState``), the device gradient buffers, and the gradient paths (to the host
in tiles, with the host worker's passes and the fp32 accumulator; or kept on the device)."""
