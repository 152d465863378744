"""Where things live: the device mesh, the logical-axis rules, and the parallelisms built on them."""
