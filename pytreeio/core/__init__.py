"""The core layer: errors, dtypes, bounded binary reading and zero-copy writing, key paths and the
restore walk, the records passed between layers, sharded leaves, checksums, bounded JSON, the
thread pool, the jit quantiser and transposes.  It imports nothing above it."""
