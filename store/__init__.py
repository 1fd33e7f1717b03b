"""The store: agent logs and served requests as calls, their tokens and the persisted indexes (SQLite).

Owns: the Store and its packs (`db`), the schema's migrations (`schema`), the writes ingest and
serve share (`calls`), log files read in (`ingest`, with one reader per format in `formats/`),
stored prompts as the model's tokens (`prompts`), choosing calls (`selection`), the persisted suffix
index (`index`) and successor table (`successors`), served requests (`served`), other stores merged
in (`merge`), the health check (`check`) and zstd (`codec`). Map: docs/design.md, "The store".
"""
