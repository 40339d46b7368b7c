"""The mesh and what is laid out on it: mesh axes, the CMS level layout, tensor-parallel splits,
and host <-> device transfers of row-sharded arrays. Imports only `nljax.errors`."""
