"""When a step happens: the step policy (immediate, delayed, during backward, speculative;
the clip and overflow decision, loss scaling) and how an update's weights reach the device
(``modes.py``). The tile loop is the rule's (``optim/rule/``), the weight copies
``optim/publish.py``'s."""
