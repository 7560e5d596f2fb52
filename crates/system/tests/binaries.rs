//! Binary resolution against search directories and paths relative to the file.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kintsugi_system::{load, parse, ErrorKind};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "kintsugi-system-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn file(path: &Path, mode: u32) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, b"#!/bin/sh\n").unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

fn demo(binary_ramfs: &str, binary_workload: &str) -> String {
    format!(
        "[system]\nname = \"demo\"\n\n\
         [[component]]\nname = \"ramfs\"\nbinary = \"{binary_ramfs}\"\nprovides = [\"fs\"]\n\n\
         [[component]]\nname = \"workload\"\nbinary = \"{binary_workload}\"\nuses = [\"fs\"]\n"
    )
}

#[test]
fn found_in_search_dirs_in_order() {
    let t = TempDir::new();
    let (a, b) = (t.0.join("a"), t.0.join("b"));
    file(&b.join("ramfs"), 0o755);
    file(&a.join("fs-workload"), 0o755);
    file(&b.join("fs-workload"), 0o755);
    let toml = t.0.join("demo.toml");
    fs::write(&toml, demo("ramfs", "fs-workload")).unwrap();
    let s = load(&toml, &[a.clone(), b.clone()]).unwrap();
    assert_eq!(s.component("ramfs").unwrap().binary, b.join("ramfs"));
    assert_eq!(
        s.component("workload").unwrap().binary,
        a.join("fs-workload")
    );
}

#[test]
fn not_found_points_at_the_binary_value() {
    let t = TempDir::new();
    let (a, b) = (t.0.join("a"), t.0.join("b"));
    file(&a.join("ramfs"), 0o755);
    file(&a.join("fs-workload"), 0o755);
    fs::create_dir_all(&b).unwrap();
    let toml = t.0.join("demo.toml");
    fs::write(&toml, demo("ramfsx", "fs-workload")).unwrap();
    let e = load(&toml, &[a.clone(), b.clone()]).unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BinaryNotFound));
    assert_eq!(
        e.to_string(),
        format!(
            "{}:6:10: component `ramfs`: binary `ramfsx` not found (looked in: {}, {})",
            toml.display(),
            a.display(),
            b.display()
        )
    );

    // A directory of that name is not a binary either; no search dirs at all.
    fs::create_dir_all(a.join("ramfsx")).unwrap();
    let e = load(&toml, std::slice::from_ref(&a)).unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BinaryNotFound));
    let e = load(&toml, &[]).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}:6:10: component `ramfs`: binary `ramfsx` not found (looked in: no search directories given)",
            toml.display()
        )
    );
}

#[test]
fn not_executable() {
    let t = TempDir::new();
    file(&t.0.join("bin/ramfs"), 0o644);
    file(&t.0.join("bin/fs-workload"), 0o755);
    let toml = t.0.join("demo.toml");
    fs::write(&toml, demo("ramfs", "fs-workload")).unwrap();
    let e = load(&toml, &[t.0.join("bin")]).unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BinaryNotExecutable));
    assert_eq!(
        e.to_string(),
        format!(
            "{}:6:10: component `ramfs`: binary `ramfs` found at {} but it is not executable",
            toml.display(),
            t.0.join("bin/ramfs").display()
        )
    );
}

#[test]
fn relative_and_absolute_paths() {
    let t = TempDir::new();
    let sys = t.0.join("systems");
    file(&sys.join("bin/ramfs"), 0o755);
    let abs = t.0.join("elsewhere/fs-workload");
    file(&abs, 0o755);
    let toml = sys.join("demo.toml");
    fs::write(&toml, demo("bin/ramfs", abs.to_str().unwrap())).unwrap();
    // Search dirs do not matter for paths.
    let s = load(&toml, &[PathBuf::from("/nonexistent")]).unwrap();
    assert_eq!(s.component("ramfs").unwrap().binary, sys.join("bin/ramfs"));
    assert_eq!(s.component("workload").unwrap().binary, abs);

    // `./ramfs` is relative to the file's directory, not to the search dirs.
    fs::write(&toml, demo("./ramfs", abs.to_str().unwrap())).unwrap();
    let e = load(&toml, &[sys.join("bin")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}:6:10: component `ramfs`: binary `./ramfs` not found (looked in: {})",
            toml.display(),
            sys.display()
        )
    );

    // parse() keeps binaries as written; resolve_binaries() resolves them later.
    let mut s = parse(&toml, &demo("bin/ramfs", abs.to_str().unwrap())).unwrap();
    assert_eq!(s.component("ramfs").unwrap().binary, Path::new("bin/ramfs"));
    s.resolve_binaries(&[]).unwrap();
    assert_eq!(s.component("ramfs").unwrap().binary, sys.join("bin/ramfs"));
}

#[test]
fn unreadable_file() {
    let t = TempDir::new();
    let e = load(&t.0.join("missing.toml"), &[]).unwrap_err();
    assert_eq!(e.kind(), None);
    assert!(e.to_string().starts_with(&format!(
        "{}: cannot read the system description:",
        t.0.join("missing.toml").display()
    )));
}
