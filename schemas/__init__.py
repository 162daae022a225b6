"""The wire: msgspec Structs exchanged between mmpipe processes."""
