//! API keys and authentication live in the operations layer
//! ([`crate::ops::auth`]), shared with MCP-over-HTTP; this path stays for
//! the handlers that name it.

pub use crate::ops::auth::*;
pub use crate::ops::Principal;
