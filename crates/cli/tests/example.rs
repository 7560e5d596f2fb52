//! The out-of-tree example (`examples/tally`): a service built against
//! kintsugi as a library, with its own interface and Rust's default
//! unwinding panics. Its server panics in a worker thread at every 97th add
//! of each incarnation and is killed besides; the runtime must turn each
//! panic into a crash, the supervisor reboot the server, and the client
//! finish with every answer right.

mod common;

use std::path::Path;

use common::*;

#[test]
fn an_out_of_tree_service_with_unwinding_panics_is_rebooted_and_loses_nothing() {
    let seed = seed("example");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let example = root.join("examples/tally");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = std::process::Command::new(cargo)
        .args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(example.join("Cargo.toml"))
        .status()
        .expect("run cargo");
    assert!(built.success(), "the example does not build");

    let dir = scratch("example");
    let system = std::fs::read_to_string(example.join("tally.toml"))
        .unwrap()
        .replace(
            "target/release/",
            &format!("{}/target/release/", example.display()),
        )
        .replace("seed = 7", &format!("seed = {seed}"));
    let system = write(&dir, "tally.toml", &system);
    let tag = unique_tag("example");
    let out = run_system(&tag, &system)
        .args(["--until-finished", "client", "--duration", "120"])
        .args([
            "--kill",
            "server",
            "--kills",
            "10",
            "--kill-every",
            "20..120",
        ])
        .args(["--signals", "kill,segv", "--seed", &seed.to_string()])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");

    let report = json_lines(&stdout)
        .into_iter()
        .find(|v| v.get("wrong").is_some())
        .unwrap_or_else(|| panic!("no client report:\n{stdout}\n{stderr}"));
    eprintln!("client: {report}");
    assert_eq!(report["ops"], 3000, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    assert_eq!(report["wrong"], 0, "{report}");

    let crashes = crashes(&stdout, "server");
    let aborted = crashes.iter().filter(|c| c.by(SIGABRT)).count();
    let panics = stderr.matches("planned panic at add").count();
    eprintln!(
        "{} crashes, {aborted} by a panic ({panics} panic messages)",
        crashes.len()
    );
    assert!(
        panics >= 20,
        "3000 adds, a panic every 97th: {panics}\n{stderr}"
    );
    // A kill may land between a panic's message and its abort.
    assert!(
        aborted <= panics && aborted + 3 >= panics,
        "every panic aborted the server:\n{stdout}"
    );
    assert_eq!(reboots(&stdout, "server"), crashes.len(), "{stdout}");
    // The supervisor was not built with `tally`: the stubs registered its
    // function names in the channel, and the panicking call is named.
    assert!(
        crashes
            .iter()
            .filter(|c| c.by(SIGABRT))
            .all(|c| c.during("tally.add")),
        "{stdout}"
    );
    assert!(leftovers(&tag).is_empty(), "processes left behind");
    let _ = std::fs::remove_dir_all(dir);
}
