//! The `kintsugi` command: run a system, check a system file, benchmark.

#![forbid(unsafe_code)]

mod control;
mod inject;
mod keeper;
mod metrics;
mod notify;
mod roster;
mod run;
mod serve;
mod status;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kintsugi",
    version,
    about = "A self-healing component runtime for Linux"
)]
struct Cli {
    /// Log lines (stderr) as text, as JSON objects one a line, or as
    /// entries in systemd's journal with their fields (the default where
    /// JOURNAL_STREAM names stderr, as under systemd); the components
    /// started inherit it (as KINTSUGI_LOG_FORMAT).
    #[arg(long, global = true, value_enum)]
    log_format: Option<LogFormat>,
    /// Colour in log lines: on a terminal only (and without NO_COLOR),
    /// always or never; the components started inherit it (as
    /// KINTSUGI_COLOR).
    #[arg(long, global = true, value_enum)]
    color: Option<Color>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
    Journal,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Color {
    Auto,
    Always,
    Never,
}

#[derive(Subcommand)]
enum Command {
    /// Run the built-in demo: ramfs and a verifying workload, with ramfs
    /// killed at random instants.
    Demo(run::DemoArgs),
    /// Run a system described by a TOML file until Ctrl-C.
    Run(run::RunArgs),
    /// Put a fault into a system that `kintsugi run` runs: a register or
    /// memory bit flip, a crash signal, a hang or a delay.
    Inject(inject::InjectArgs),
    /// Checkpoint a component of a system that `kintsugi run` runs, at
    /// its next safe point, and print what it took.
    Checkpoint(control::CheckpointArgs),
    /// Restore a component of a running system from its latest checkpoint
    /// (in place, keeping its pid) or from an image file.
    Restore(control::RestoreArgs),
    /// Show every component of a running system: state, pid, epoch,
    /// restarts, reboot times, descriptors recovered, hangs, counters.
    Status(status::StatusArgs),
    /// Stop a running system (clients first, as Ctrl-C does).
    Stop(status::StopArgs),
    /// Restart one component of a running system (killed and micro-rebooted).
    Restart(status::RestartArgs),
    /// Run a system with checking workloads, inject faults one at a time
    /// and classify what each did.
    Campaign(kintsugi_campaign::CampaignArgs),
    /// Check a system file and print its start order.
    Check { system: PathBuf },
    /// Benchmarks (build with --release): runs `kintsugi-bench`, found next
    /// to this executable or on $PATH (`kintsugi bench --help` lists them).
    #[command(disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Print a shell completion script (e.g. `kintsugi completions bash >
    /// /etc/bash_completion.d/kintsugi`).
    Completions { shell: clap_complete::Shell },
    /// Print the man page (roff; `kintsugi man | man -l -`).
    Man,
    /// Print each interface's IDL line count.
    IdlLines {
        /// Folder of .kidl files.
        #[arg(default_value = "crates/interfaces/idl")]
        dir: PathBuf,
    },
}

/// Sets up this process's logs as `KINTSUGI_LOG_FORMAT` says: to stderr
/// (stdout carries the event log, tables and JSON) as text, in colour as
/// `--color` says, or as JSON lines; or to systemd's journal, through
/// `tracing-journald`, with their fields. A journal that cannot be reached
/// is an error if `--log-format journal` asked for it, else (found through
/// `JOURNAL_STREAM`) text is used instead.
fn init_logs(explicit: bool) -> Result<(), std::process::ExitCode> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_env("KINTSUGI_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
    };
    let format = std::env::var("KINTSUGI_LOG_FORMAT").unwrap_or_default();
    if format == "journal" {
        match tracing_journald::layer() {
            Ok(layer) => {
                let layer = layer
                    .with_field_prefix(None)
                    .with_syslog_identifier("kintsugi".into());
                tracing_subscriber::registry()
                    .with(filter())
                    .with(layer)
                    .init();
                return Ok(());
            }
            Err(e) if explicit => {
                eprintln!(
                    "kintsugi: --log-format journal: no journal at {}: {e}",
                    kintsugi_supervisor::journald::SOCKET
                );
                return Err(std::process::ExitCode::from(2));
            }
            Err(_) => std::env::set_var("KINTSUGI_LOG_FORMAT", "text"),
        }
    }
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter())
        .with_writer(std::io::stderr)
        .with_target(false);
    if kintsugi_runtime::logging::json_requested() {
        // One JSON object per line, with its wall-clock time.
        logs.json().init();
    } else {
        logs.with_ansi(kintsugi_runtime::logging::ansi_wanted())
            .without_time()
            .init();
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Set before any thread starts; components inherit the environment.
    let format = cli.log_format.or_else(|| {
        kintsugi_supervisor::journald::stderr_is_journal().then_some(LogFormat::Journal)
    });
    if let Some(format) = format {
        let value = match format {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
            LogFormat::Journal => "journal",
        };
        std::env::set_var("KINTSUGI_LOG_FORMAT", value);
    }
    if let Some(color) = cli.color {
        let value = match color {
            Color::Auto => "auto",
            Color::Always => "always",
            Color::Never => "never",
        };
        std::env::set_var("KINTSUGI_COLOR", value);
    }
    if let Err(code) = init_logs(cli.log_format.is_some()) {
        return code;
    }
    let result = match cli.command {
        Command::Demo(args) => run::demo(args),
        Command::Run(args) => run::run(args),
        Command::Check { system } => run::check(&system),
        Command::Inject(args) => inject::inject(args),
        Command::Checkpoint(args) => control::checkpoint(args),
        Command::Restore(args) => control::restore(args),
        Command::Status(args) => status::status(args),
        Command::Stop(args) => status::stop(args),
        Command::Restart(args) => status::restart(args),
        Command::Campaign(args) => kintsugi_campaign::campaign(args),
        Command::Bench { args } => bench(&args),
        Command::IdlLines { dir } => idl_lines(&dir),
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "kintsugi", &mut std::io::stdout());
            Ok(true)
        }
        Command::Man => clap_mangen::Man::new(<Cli as clap::CommandFactory>::command())
            .render(&mut std::io::stdout())
            .map(|()| true)
            .map_err(Into::into),
    };
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// Hands `kintsugi bench ARGS` over to the `kintsugi-bench` binary.
fn bench(args: &[std::ffi::OsString]) -> anyhow::Result<bool> {
    use std::os::unix::process::CommandExt;
    let dirs = kintsugi_system::search_dirs();
    let Some(binary) = dirs
        .iter()
        .map(|d| d.join("kintsugi-bench"))
        .find(|p| p.is_file())
    else {
        anyhow::bail!(
            "`kintsugi bench` runs the kintsugi-bench binary, found neither next to \
             this executable nor on $PATH (install it: cargo install --path crates/bench)"
        );
    };
    let err = std::process::Command::new(&binary).args(args).exec();
    Err(anyhow::anyhow!("{}: {err}", binary.display()))
}

fn idl_lines(dir: &std::path::Path) -> anyhow::Result<bool> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "kidl"))
        .collect();
    files.sort();
    println!("| interface | IDL lines |\n| --- | --- |");
    let mut ok = true;
    for f in files {
        let text = std::fs::read_to_string(&f)?;
        kintsugi_idl::parse(&f, &text).map_err(|e| anyhow::anyhow!("{e}"))?;
        let n = kintsugi_idl::spec_lines(&text);
        ok &= n <= 40;
        println!("| {} | {n} |", f.file_stem().unwrap().to_string_lossy());
    }
    Ok(ok)
}
