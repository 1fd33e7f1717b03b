"""Cost: what a forward pass costs, and how much draft that pays for.

Owns: fixed cost curves and the interface the decode loop asks of any cost (`forward`: ForwardCost,
PassCost, check_curve), the curves shipped with specx (`shipped`, their files in `curves/`), the
acceptance model, what each draft node is worth (`acceptance`), the cut of a draft where expected
tokens per second peak (`sizing`), the curve learned from the passes (`curve`, its kept state
checked in `kept_state`), the guard that caps drafts that do not pay (`guard`), and the two
together as one learned cost, kept in a file its caller names (`learned`). Core chooses no path:
the command line says where a learned cost is kept. Timing passes on demand (`specx bench cost`)
is the measuring package's (specx.bench.calibrate).

May import: numpy, core.draft, core.kept. Not the index, the model or anything above: decode,
predict and serve import it.
"""
