"""Where a step happens: the step policy (immediate, delayed, during backward, speculative;
the clip and overflow decision, loss scaling), the CPU Adam tile loop and the publication
of updated weights."""
