"""The simulator in parts (the facade is :class:`autodist.cost.simulator.Simulator`): the program's
data (:mod:`.program`), compiling a plan into it (:mod:`.emit`, with :mod:`.gathers`,
:mod:`.reductions`, :mod:`.recompute` and :mod:`.offload`), and timing it (:mod:`.execute`)."""
