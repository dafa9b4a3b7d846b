//! JSON-RPC 2.0 framing for MCP: classify one incoming message, build
//! responses and errors. MCP forbids batches (2025-06-18 on) and null ids.

use serde_json::{json, Map, Value};

pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;
/// Server busy (implementation-defined range).
pub const SERVER_BUSY: i64 = -32000;
/// 2026-07-28: HTTP headers disagree with the body.
pub const HEADER_MISMATCH: i64 = -32020;
/// 2026-07-28: protocol version not supported.
pub const UNSUPPORTED_PROTOCOL_VERSION: i64 = -32022;

/// A JSON-RPC error to send back.
#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    pub data: Option<Value>,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }
    pub fn invalid_params(m: impl Into<String>) -> RpcError {
        Self::new(INVALID_PARAMS, m)
    }
    pub fn invalid_request(m: impl Into<String>) -> RpcError {
        Self::new(INVALID_REQUEST, m)
    }
    pub fn with_data(mut self, d: Value) -> RpcError {
        self.data = Some(d);
        self
    }
}

/// One classified incoming message.
#[derive(Debug)]
pub enum Incoming {
    Request {
        id: Value,
        method: String,
        params: Map<String, Value>,
    },
    Notification {
        method: String,
        params: Map<String, Value>,
    },
    /// A response to a request of ours (we send none; ignored).
    Response,
}

/// Parses bytes into a message. `Err((id, error))`: answer with that error
/// (`id` is `None` when it could not be determined).
pub fn parse(bytes: &[u8]) -> Result<Incoming, (Option<Value>, RpcError)> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| {
        (
            None,
            RpcError::new(PARSE_ERROR, format!("parse error: {e}")),
        )
    })?;
    classify(v)
}

pub fn classify(v: Value) -> Result<Incoming, (Option<Value>, RpcError)> {
    let mut obj = match v {
        Value::Object(o) => o,
        Value::Array(_) => {
            return Err((
                None,
                RpcError::invalid_request("JSON-RPC batches are not supported by MCP"),
            ))
        }
        _ => {
            return Err((
                None,
                RpcError::invalid_request("a JSON-RPC message must be an object"),
            ))
        }
    };
    // An id we can echo: string or integer only (MCP forbids null).
    let id = match obj.remove("id") {
        None => None,
        Some(id @ Value::String(_)) => Some(id),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Some(Value::Number(n)),
        Some(other) => {
            return Err((
                None,
                RpcError::invalid_request(format!(
                    "id must be a string or an integer, not {}",
                    type_name(&other)
                )),
            ))
        }
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err((id, RpcError::invalid_request("jsonrpc must be \"2.0\"")));
    }
    let method = match obj.remove("method") {
        Some(Value::String(m)) => m,
        Some(_) => return Err((id, RpcError::invalid_request("method must be a string"))),
        None => {
            if id.is_some() && (obj.contains_key("result") || obj.contains_key("error")) {
                return Ok(Incoming::Response);
            }
            return Err((id, RpcError::invalid_request("missing method")));
        }
    };
    let params = match obj.remove("params") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(p)) => p,
        Some(other) => {
            return Err((
                id,
                RpcError::invalid_params(format!(
                    "params must be an object, not {}",
                    type_name(&other)
                )),
            ))
        }
    };
    Ok(match id {
        Some(id) => Incoming::Request { id, method, params },
        None => Incoming::Notification { method, params },
    })
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub fn response(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

/// An error response. Without a known id the member is left out: the MCP
/// schemas type `id` as string|integer, so `null` would not validate.
pub fn error(id: Option<&Value>, e: &RpcError) -> Value {
    let mut err = json!({"code": e.code, "message": e.message});
    if let Some(d) = &e.data {
        err["data"] = d.clone();
    }
    let mut v = json!({"jsonrpc": "2.0", "error": err});
    if let Some(id) = id {
        v["id"] = id.clone();
    }
    v
}

pub fn notification(method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "method": method, "params": params})
}

/// A stable map key for a request id (`"s:abc"` / `"n:5"`).
pub fn id_key(id: &Value) -> String {
    match id {
        Value::String(s) => format!("s:{s}"),
        other => format!("n:{other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_messages() {
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#),
            Ok(Incoming::Request { .. })
        ));
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            Ok(Incoming::Notification { .. })
        ));
        let (_, e) = parse(b"{nope").unwrap_err();
        assert_eq!(e.code, PARSE_ERROR);
        let (_, e) = parse(b"[]").unwrap_err();
        assert_eq!(e.code, INVALID_REQUEST);
        let (id, e) =
            parse(br#"{"jsonrpc":"2.0","id":"x","method":"a","params":[1]}"#).unwrap_err();
        assert_eq!(e.code, INVALID_PARAMS);
        assert_eq!(id, Some(json!("x")));
        let (_, e) = parse(br#"{"jsonrpc":"2.0","id":null,"method":"a"}"#).unwrap_err();
        assert_eq!(e.code, INVALID_REQUEST);
        let (_, e) = parse(br#"{"jsonrpc":"1.0","id":1,"method":"a"}"#).unwrap_err();
        assert_eq!(e.code, INVALID_REQUEST);
    }
}
