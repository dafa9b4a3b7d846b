//! Streamable HTTP transport at `/mcp` (filled in below).
