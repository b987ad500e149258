"""Native kernels, as real source files beside their Python wrappers (``cpu/``)."""
