use std::process::ExitCode;

fn main() -> ExitCode {
    match shimmer_coordinator::cli::run() {
        Ok(code) => code,
        Err(e) => {
            // One line, naming the problem; no backtrace.
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}
