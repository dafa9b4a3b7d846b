fn main() {
    env_logger::init();
    eprintln!("agent-sandbox {}", env!("CARGO_PKG_VERSION"));
}
