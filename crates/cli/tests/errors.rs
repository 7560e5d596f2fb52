//! Bad input gets a clear error naming the file, line and column, and
//! failures at run time say what failed.

mod common;

use common::*;
use kintsugi_supervisor::GiveUpReason;

const RAMFS: &str =
    "[[component]]\nname = \"ramfs\"\nbinary = \"kintsugi-ramfs\"\nprovides = [\"fs\"]\n";

fn check(dir: &std::path::Path, name: &str, body: &str) -> String {
    let path = write(dir, name, body);
    let out = kintsugi("errors")
        .args(["check", path.to_str().unwrap()])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "expected a usage error\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stderr
}

#[test]
fn malformed_system_file_names_file_line_and_column() {
    let dir = scratch("errors-syntax");
    let err = check(
        &dir,
        "bad.toml",
        "[system]\nname = \"x\"\n\n[[component]]\nname = ramfs\n",
    );
    assert!(err.contains("bad.toml:5:8:"), "{err}");
}

#[test]
fn missing_binary_says_which_and_where() {
    let dir = scratch("errors-binary");
    let err = check(
        &dir,
        "nobin.toml",
        "[system]\nname = \"x\"\n\n[[component]]\nname = \"a\"\nbinary = \"no-such-binary\"\n",
    );
    assert!(err.contains("nobin.toml:6:10:"), "{err}");
    assert!(err.contains("binary `no-such-binary` not found"), "{err}");
}

#[test]
fn dependency_on_an_interface_nobody_provides() {
    let dir = scratch("errors-provider");
    let body = format!("[system]\nname = \"x\"\n\n{RAMFS}\n[[component]]\nname = \"w\"\nbinary = \"kintsugi-fs-workload\"\nuses = [\"fsx\"]\n");
    let err = check(&dir, "noprov.toml", &body);
    assert!(err.contains("noprov.toml:12:"), "{err}");
    assert!(
        err.contains("uses interface `fsx`, which no component provides"),
        "{err}"
    );
}

#[test]
fn a_cycle_cannot_start() {
    let dir = scratch("errors-cycle");
    let body = "[system]\nname = \"x\"\n\n[[component]]\nname = \"a\"\nbinary = \"kintsugi-ramfs\"\nprovides = [\"fs\"]\nuses = [\"bench\"]\n\n[[component]]\nname = \"b\"\nbinary = \"kintsugi-bench-echo\"\nprovides = [\"bench\"]\nuses = [\"fs\"]\n";
    let err = check(&dir, "cycle.toml", body);
    assert!(err.contains("cycle.toml:8:"), "{err}");
    assert!(
        err.contains("dependency cycle a -> b -> a: the system cannot start"),
        "{err}"
    );
}

#[test]
fn malformed_idl_file_names_file_line_and_column() {
    let dir = scratch("errors-idl");
    write(
        &dir,
        "broken.kidl",
        "interface broken;\n\nfn open(path: str rememebr) -> unit;\n",
    );
    let out = kintsugi("errors")
        .args(["idl-lines", dir.to_str().unwrap()])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("broken.kidl:3:19:"), "{stderr}");
    assert!(stderr.contains("rememebr"), "{stderr}");
}

#[test]
fn a_component_pinned_to_a_cpu_the_supervisor_may_not_use_is_refused_and_named() {
    let dir = scratch("errors-cpus");
    let system = write(
        &dir,
        "cpus.toml",
        &format!("[system]\nname = \"x\"\n\n{RAMFS}cpus = [1023]\n"),
    );
    let tag = unique_tag("cpus");
    let out = kintsugi(&tag)
        .args(["run", system.to_str().unwrap()])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_ne!(out.status.code(), Some(0), "stdout:\n{stdout}");
    assert!(stderr.contains("ramfs"), "{stderr}");
    assert!(
        stderr.contains("cpus lists CPU 1023, which the supervisor may not use"),
        "{stderr}"
    );
    assert!(leftovers(&tag).is_empty());
}

#[test]
fn a_binary_that_is_not_a_component_fails_to_boot_and_says_so() {
    let dir = scratch("errors-boot");
    let system = write(&dir, "boot.toml", "[system]\nname = \"x\"\n\n[[component]]\nname = \"fake\"\nbinary = \"/bin/true\"\nprovides = [\"fs\"]\n");
    let tag = unique_tag("boot");
    let out = kintsugi(&tag)
        .args(["run", system.to_str().unwrap()])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains(
            "component `fake` failed to boot: the process exited during boot with exit code 0"
        ),
        "{stderr}"
    );
    assert!(leftovers(&tag).is_empty());
}

#[test]
fn a_component_past_its_restart_policy_is_given_up_and_its_clients_are_told() {
    let seed = seed("restart_policy");
    let dir = scratch("errors-policy");
    let body = "[system]\nname = \"x\"\n\n[[component]]\nname = \"ramfs\"\nbinary = \"kintsugi-ramfs\"\nprovides = [\"fs\"]\nrestart = { max = 2, window_ms = 60000 }\n\n[[component]]\nname = \"workload\"\nbinary = \"kintsugi-fs-workload\"\nuses = [\"fs\"]\n";
    let system = write(&dir, "policy.toml", body);
    let tag = unique_tag("policy");
    let out = run_system(&tag, &system)
        .args(["--kill", "ramfs", "--kills", "3", "--kill-every", "30..60"])
        .args(["--seed", &seed.to_string()])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        events(&stdout).iter().any(|e| matches!(
            e,
            Event::GaveUp {
                component,
                reason: GiveUpReason::Policy { restarts: 3, max: 2, window_ms: 60000 },
                ..
            } if component == "ramfs"
        )),
        "{stdout}"
    );
    assert!(
        stderr.contains("server component `ramfs` is gone"),
        "the client must learn why: {stderr}"
    );
    assert!(leftovers(&tag).is_empty());
}

/// A component binary built against another layout of the runtime's
/// shared memory (here: a boot description from a supervisor that says
/// another one) refuses to boot, naming both, before it maps anything.
#[test]
fn a_component_of_another_runtime_layout_refuses_to_boot() {
    let ramfs =
        std::path::Path::new(env!("CARGO_BIN_EXE_kintsugi")).with_file_name("kintsugi-ramfs");
    let boot = serde_json::json!({
        "abi": 1,
        "component": "ramfs",
        "id": 1,
        "control_fd": 1000,
        "zygote_fd": 1001,
        "vault_fd": 1002,
        "provides": [],
        "uses": [],
        "config": {},
    });
    let out = std::process::Command::new(&ramfs)
        .env("KINTSUGI_BOOT", boot.to_string())
        .env("KINTSUGI_LOG", "off")
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(3), "stderr:\n{stderr}");
    assert!(
        stderr.contains("`ramfs` was built against a kintsugi runtime whose shared memory is laid out otherwise")
            && stderr.contains("the supervisor's 0x0000000000000001"),
        "stderr:\n{stderr}"
    );
}
