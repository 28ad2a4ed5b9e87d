//! Shell completions and man pages, generated from the CLI's own definition (clap_complete,
//! clap_mangen) so they never drift from `--help`. The package installs both; from source:
//! `ferrosan completions bash > /etc/bash_completion.d/ferrosan`, `ferrosan man --dir DIR`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, CommandFactory};
use clap_complete::Shell;

#[derive(Args)]
pub struct CompletionsArgs {
    /// The shell to complete for: bash, zsh, fish, elvish or powershell.
    shell: Shell,
}

#[derive(Args)]
pub struct ManArgs {
    /// Directory the pages are written to: ferrosan.1, one ferrosan-COMMAND.1 per
    /// (sub)command (e.g. ferrosan-ctl-device-add.1), and ferrosan.toml.5 for the config file.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
}

/// Prints the completion script for `args.shell` on stdout.
pub fn completions(args: CompletionsArgs) -> ExitCode {
    let mut cmd = crate::Cli::command();
    clap_complete::generate(args.shell, &mut cmd, "ferrosan", &mut std::io::stdout());
    ExitCode::SUCCESS
}

/// Writes the man pages into `args.dir`.
pub fn man(args: ManArgs) -> ExitCode {
    match write_man_pages(&args.dir) {
        Ok(n) => {
            eprintln!("{n} man pages written to {}", args.dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ferrosan man: {}: {e}", args.dir.display());
            ExitCode::FAILURE
        }
    }
}

/// Every page, named as man(1) finds them (`man ferrosan-ctl-device-add`), with the
/// sections the CLI's definition cannot give (`man_extra.rs`); how many.
pub fn write_man_pages(dir: &Path) -> std::io::Result<usize> {
    std::fs::create_dir_all(dir)?;
    let before = pages_in(dir)?;
    clap_mangen::generate_to(crate::Cli::command(), dir)?;
    for entry in std::fs::read_dir(dir)?.filter_map(Result::ok) {
        let path = entry.path();
        let Some(name) = path
            .extension()
            .filter(|x| *x == "1")
            .and(path.file_stem())
            .and_then(|s| s.to_str())
        else {
            continue;
        };
        let page = std::fs::read_to_string(&path)?;
        let sections = crate::man_extra::sections(name);
        std::fs::write(&path, crate::man_extra::append(&page, &sections))?;
    }
    // The config file's page (section 5: file formats), from docs/CONFIG.md.
    std::fs::write(dir.join("ferrosan.toml.5"), crate::config_man::page())?;
    Ok(pages_in(dir)? - before)
}

fn pages_in(dir: &Path) -> std::io::Result<usize> {
    Ok(std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "1" || x == "5"))
        .count())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command and every argument says what it is for: `--help`, the man pages and the
    /// completions' descriptions all come from these strings.
    #[test]
    fn every_command_and_argument_has_help_text() {
        fn walk(cmd: &clap::Command, path: &str, blank: &mut Vec<String>) {
            let path = format!("{path} {}", cmd.get_name());
            if cmd.get_about().is_none() && path != " ferrosan" {
                blank.push(format!("{path}: no about"));
            }
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "version") {
                    continue;
                }
                if arg
                    .get_help()
                    .is_none_or(|h| h.to_string().trim().is_empty())
                {
                    blank.push(format!("{path}: argument {id} has no help"));
                }
            }
            // clap's own `help` subcommands describe themselves.
            for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
                walk(sub, &path, blank);
            }
        }
        let mut cmd = crate::Cli::command();
        cmd.build();
        let mut blank = Vec::new();
        walk(&cmd, "", &mut blank);
        assert!(blank.is_empty(), "{}", blank.join("\n"));
    }

    #[test]
    fn man_pages_name_every_command() {
        let dir = std::env::temp_dir().join(format!("ferrosan-man-{}", std::process::id()));
        let n = write_man_pages(&dir).unwrap();
        let page = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(page("ferrosan.1").contains("ferrosan\\-serve(1)"));
        assert!(page("ferrosan-ctl-device-add.1").contains(".SH NAME"));
        // What the CLI's definition cannot say, on the pages people read first.
        for name in ["ferrosan.1", "ferrosan-serve.1", "ferrosan-ctl.1"] {
            for section in ["EXAMPLES", "FILES", "EXIT STATUS", "SEE ALSO"] {
                let heading = format!(".SH \"{section}\"");
                assert!(page(name).contains(&heading), "{name}: no {section}");
            }
        }
        let add = page("ferrosan-ctl-device-add.1");
        assert!(add.contains(".SH \"EXIT STATUS\""));
        assert!(add.contains("\\fBferrosan\\-ctl\\-device\\fR(1)"), "{add}");
        assert!(page("ferrosan-check-config.1").contains("\\-\\-deep"));
        let mut commands = 0;
        fn count(cmd: &clap::Command, n: &mut usize) {
            *n += 1;
            cmd.get_subcommands().for_each(|s| count(s, n));
        }
        let mut cmd = crate::Cli::command().disable_help_subcommand(true);
        cmd.build();
        count(&cmd, &mut commands);
        assert_eq!(
            n,
            commands + 1,
            "one page per command, and ferrosan.toml(5)"
        );
        assert!(page("ferrosan.toml.5").contains(".SH \"FILE FORMAT\""));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn completions_offer_the_subcommands() {
        for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut crate::Cli::command(), "ferrosan", &mut out);
            let text = String::from_utf8(out).unwrap();
            for sub in ["serve", "ctl", "check-config", "completions"] {
                assert!(text.contains(sub), "{shell}: no {sub}");
            }
        }
    }
}
