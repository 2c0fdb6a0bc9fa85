"""HTTP routes, one module per API surface; each route only translates and delegates."""
