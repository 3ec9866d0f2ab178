"""The engine: format choice, option routing, encode/decode/restore and conversion."""
