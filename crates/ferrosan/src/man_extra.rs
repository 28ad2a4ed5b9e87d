//! What a man page says beyond the CLI's own definition: examples, the files read and
//! written, exit statuses and related pages, appended as roff sections to the pages clap_mangen
//! generates. Kept beside the code whose behaviour they describe (exit codes: main.rs, ctl.rs).

/// A section: its title and its roff body.
type Section = (&'static str, &'static str);

const FILES: Section = (
    "FILES",
    r#".TP
\fI/etc/ferrosan/ferrosan.toml\fR
The config the packaged unit serves (every key:
\fI/usr/share/doc/ferrosan/docs/CONFIG.md\fR); \fBferrosan ctl save\fR writes live changes
back to it.
.TP
\fI/etc/ferrosan/secrets/\fR
CHAP and DH\-HMAC\-CHAP secrets, one file each (mode 0600), named by the config's
\fBsecret_file\fR keys.
.TP
\fI/run/ferrosan/control.sock\fR
The control socket \fBferrosan ctl\fR talks to (root's default; others:
\fI$XDG_RUNTIME_DIR/ferrosan/control.sock\fR).
.TP
\fI/var/lib/ferrosan/\fR
The state directory: persistent reservations, volumes of directory pools, API tokens (root's
default; others: \fI$XDG_STATE_HOME/ferrosan\fR).
.TP
\fI/usr/share/doc/ferrosan/\fR
README.md, the guides and the reference (docs/CONFIG.md, docs/OPERATIONS.md, ...).
"#,
);

const SERVE_EXAMPLES: Section = (
    "EXAMPLES",
    r#"Serve the embedded demo (a 64 MiB RAM LUN on 127.0.0.1:3260), no config needed:
.PP
.nf
.RS
ferrosan serve
.RE
.fi
.PP
Serve a config, with the control socket the packaged unit uses:
.PP
.nf
.RS
ferrosan serve \-\-config /etc/ferrosan/ferrosan.toml \-\-control\-socket /run/ferrosan/control.sock
.RE
.fi
.PP
Export one file for a quick test, without a config:
.PP
.nf
.RS
ferrosan serve \-\-lun file:/var/lib/ferrosan/disk1.img,size=10G
.RE
.fi
"#,
);

const SERVE_EXIT: Section = (
    "EXIT STATUS",
    r#".TP
.B 0
Stopped cleanly (SIGTERM or SIGINT: sessions asked to log out, every LU flushed).
.TP
.B 1
Could not start: a device could not be opened, a listener could not be bound, the control
socket's directory is unsafe, and so on (the reason on standard error).
.TP
.B 2
The command line or the config is invalid, or an RBD gateway's settings are.
"#,
);

const CTL_EXAMPLES: Section = (
    "EXAMPLES",
    r#"Add a disk and map it to a host's group, live, then keep the change:
.PP
.nf
.RS
ferrosan ctl device add disk2 block:/dev/md1
ferrosan ctl lun map iqn.2026\-12.org.example:disk1 host01 1 disk2
ferrosan ctl save
.RE
.fi
.PP
See who is logged in, and what each LUN serves:
.PP
.nf
.RS
ferrosan ctl sessions
ferrosan ctl luns
.RE
.fi
.PP
Create a 20 GiB volume in pool \fBssd\fR and export it to a Kubernetes node:
.PP
.nf
.RS
ferrosan ctl volume create ssd pvc\-1 20G
ferrosan ctl volume export pvc\-1 \-\-initiator iqn.1993\-08.org.debian:01:node1
.RE
.fi
"#,
);

const CTL_EXIT: Section = (
    "EXIT STATUS",
    r#".TP
.B 0
The daemon did what was asked.
.TP
.B 1
The daemon refused it (the reason on standard error, or in the reply with \fB\-\-json\fR);
nothing changed.
.TP
.B 2
The daemon could not be reached, or the request could not be made.
"#,
);

const CHECK_EXAMPLES: Section = (
    "EXAMPLES",
    r#"Check a config before a restart or a reload, and whether this host can serve it (its
devices, pools, addresses and clusters):
.PP
.nf
.RS
ferrosan check\-config /etc/ferrosan/ferrosan.toml
ferrosan check\-config \-\-deep /etc/ferrosan/ferrosan.toml
.RE
.fi
"#,
);

const CHECK_EXIT: Section = (
    "EXIT STATUS",
    r#".TP
.B 0
The config is valid (with \fB\-\-deep\fR: and this host can serve it).
.TP
.B 1
It is not: every error is on standard error, with its line and column.
"#,
);

const MAIN_EXIT: Section = (
    "EXIT STATUS",
    r#"That of the command run (see its page); 2 for a command line that does not parse.
"#,
);

const SEE_ALSO_MAIN: &str = r#"\fBferrosan\-serve\fR(1), \fBferrosan\-ctl\fR(1), \fBferrosan\-check\-config\fR(1), \fBferrosan\-top\fR(1), \fBiscsiadm\fR(8), \fBnvme\fR(1), \fBsystemctl\fR(1)
"#;

/// The sections for the page `name` (e.g. `ferrosan-serve`), in the order they follow the
/// generated ones.
pub fn sections(name: &str) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = match name {
        "ferrosan" => vec![own(SERVE_EXAMPLES), own(FILES), own(MAIN_EXIT)],
        "ferrosan-serve" => vec![own(SERVE_EXAMPLES), own(FILES), own(SERVE_EXIT)],
        "ferrosan-ctl" => vec![own(CTL_EXAMPLES), own(FILES), own(CTL_EXIT)],
        "ferrosan-check-config" => vec![own(CHECK_EXAMPLES), own(CHECK_EXIT)],
        _ if name.starts_with("ferrosan-ctl-") => vec![own(CTL_EXIT)],
        _ => Vec::new(),
    };
    out.push(("SEE ALSO", see_also(name)));
    out
}

fn own((title, body): Section) -> (&'static str, String) {
    (title, body.to_string())
}

/// The main pages but this one, and for a subcommand its parent command's page first.
fn see_also(name: &str) -> String {
    let own = format!("\\fB{}\\fR(1), ", name.replace('-', "\\-"));
    let main = SEE_ALSO_MAIN.replace(&own, "");
    match name.rsplit_once('-') {
        Some((parent, _)) if parent != "ferrosan" && name != "ferrosan-check-config" => {
            format!("\\fB{}\\fR(1), {main}", parent.replace('-', "\\-"))
        }
        _ => main,
    }
}

/// `page` with `sections` appended, each a `.SH` heading and its body.
pub fn append(page: &str, sections: &[(&'static str, String)]) -> String {
    let mut out = page.trim_end().to_string();
    out.push('\n');
    for (title, body) in sections {
        out.push_str(&format!(".SH \"{title}\"\n{}", body));
        if !body.ends_with('\n') {
            out.push('\n');
        }
    }
    out
}
