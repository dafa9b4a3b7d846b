fn main() {
    eprintln!("sandbox-agent: not built yet");
    std::process::exit(1);
}
