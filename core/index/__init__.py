"""The suffix index: every stored output in one searchable structure, drafts in microseconds.

Owns: suffix arrays and their compiled search (`suffix_array`), finished sequences in segments
(`sealed`), the request's own growing sequence (`live`) and its prefix array (`prefix_array`), a
node's children and the best-first draft tree (`children`, `expand`), the index itself, the flat
view of it its kernels take and its file format (`suffix_index`, `kernel_view`, `index_format`, with
the suffix array's compact Psi form), token-id checks (`tokens`), what a serving engine drives for many requests at once (`suffix_cache`, `engine_step`),
and the successor table, each token's likely next tokens as the model predicted them (`successors`).

May import: numpy, numba (through core.numba_cache), core.draft, core.kept_schema. Nothing about models.
"""
