"""Example third-party tandem plugin: `fifo` eviction and the `repeat_last` speculator."""
