//! File tools: write, read, list.

use super::*;

pub(super) fn write_file(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &write_file_in())?;
    let id = session_id(a)?;
    let path = req_str(a, "path")?;
    validate::path(&path, "path").map_err(op_msg)?;
    let content = req_str(a, "content")?;
    let data = match opt_str(a, "encoding")?.as_deref() {
        None | Some("utf8") => content.into_bytes(),
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(content.as_bytes())
            .map_err(|e| format!("content is not valid base64: {e}"))?,
        Some(o) => return Err(format!("encoding {o:?}: want utf8 or base64")),
    };
    let s = own_session(ctx, &id)?;
    let _a = s.activity();
    let n = ops_files::write(&s, &path, &data, None, wait(ctx)).map_err(op_msg)?;
    Ok(json!({"sessionId": id, "path": path, "bytes": n}).into())
}

pub(super) fn read_file(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &path_in())?;
    let id = session_id(a)?;
    let path = req_str(a, "path")?;
    validate::path(&path, "path").map_err(op_msg)?;
    let s = own_session(ctx, &id)?;
    let _a = s.activity();
    let mut lease = ctx.host.ops.reply_lease().map_err(op_msg)?;
    // Base64 grows 4/3 and must fit in one message.
    let max = (crate::mcp::MAX_MESSAGE as u64 / 2).min(ctx.host.ops.cfg.max_file as u64);
    let data = ops_files::read(&s, &mut lease, &path, max, wait(ctx)).map_err(op_msg)?;
    // Text that JSON escapes to more than its base64 (control bytes take
    // six bytes each) goes as base64 too: the answer stays within 4/3.
    let as_text = std::str::from_utf8(&data)
        .is_ok_and(|t| crate::budget::json_len(t) <= ops_files::base64_len(t.len()) + 2);
    let c = ops_files::content(&mut lease, &path, data, !as_text).map_err(op_msg)?;
    // The structured copy and the one in the text block.
    lease
        .grow(2 * c.content.len() as u64)
        .map_err(|e| e.to_string())?;
    if c.encoding == "utf8" {
        return Ok(
            json!({"path": path, "size": c.size, "encoding": "utf8", "content": c.content}).into(),
        );
    }
    let uri = format!("sandbox://{id}/{}", path.trim_start_matches('/'));
    let b64 = c.content;
    Ok(ToolOut {
        structured: json!({"path": path, "size": c.size, "encoding": "base64", "content": b64}),
        extra: vec![json!({"type": "resource", "resource": {
            "uri": uri, "mimeType": "application/octet-stream", "blob": b64}})],
    })
}

pub(super) fn list_files(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &list_files_in())?;
    let id = session_id(a)?;
    let path = opt_str(a, "path")?.unwrap_or_else(|| ".".into());
    validate::path(&path, "path").map_err(op_msg)?;
    let recursive = opt_bool(a, "recursive")?.unwrap_or(false);
    let s = own_session(ctx, &id)?;
    let _a = s.activity();
    let mut lease = ctx.host.ops.reply_lease().map_err(op_msg)?;
    let l = ops_files::list(&s, &mut lease, &path, recursive, wait(ctx)).map_err(op_msg)?;
    // Sized before it becomes a `Value` (ten times the bytes).
    let len = crate::budget::json_len(&l);
    if len > crate::mcp::MAX_MESSAGE / 2 {
        return Err(crate::budget::too_large(
            len,
            crate::mcp::MAX_MESSAGE / 2,
            "list a subdirectory, or without recursive",
        )
        .to_string());
    }
    lease.grow(10 * len as u64).map_err(|e| e.to_string())?;
    Ok(serde_json::to_value(&l)
        .map_err(|e| format!("listing: {e}"))?
        .into())
}
