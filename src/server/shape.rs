//! The error shape a target's API answers in: what the front ends render
//! and what `httpd` writes for a request it refuses (its own module, so
//! `httpd` and `http` do not import each other).

use serde_json::json;

/// The error shape of an API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `{"error": {"code", "message"}}`: `/v1` and any other path.
    Nested,
    /// `{"error": "<message>", "code"}`: the seed's routes.
    Seed,
}

impl Shape {
    /// The shape for a request target (path, with or without a query):
    /// the seed's routes are `/exec[/...]`, `/admin[/...]`, `/health` and
    /// `/ready`, whatever the method and whether the route exists.
    pub fn for_target(target: &str) -> Shape {
        let path = target.split(['?', '#']).next().unwrap_or("");
        let first = path.trim_start_matches('/').split('/').next().unwrap_or("");
        match first {
            "exec" | "admin" | "health" | "ready" => Shape::Seed,
            _ => Shape::Nested,
        }
    }

    pub fn body(self, code: &str, message: &str) -> serde_json::Value {
        match self {
            Shape::Nested => json!({"error": {"code": code, "message": message}}),
            Shape::Seed => json!({"error": message, "code": code}),
        }
    }
}
