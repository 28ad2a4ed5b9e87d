use super::*;

const FILE: &str = "ferrosan.toml";

fn device(name: &str, size_mib: usize) -> String {
    format!("[[device]]\nname = \"{name}\"\nstore = \"ram\"\nsize = \"{size_mib}M\"\n")
}

/// A config of `devices` (tables), the first mapped by a target after them.
fn file_of(devices: &[String]) -> String {
    format!(
        "[server]\nidentity_seed = \"rack 4\"\n\n[[portal_group]]\ntag = 1\n\
         listen = [\"127.0.0.1:3260\"]\n\n{}\n[[target]]\niqn = \"iqn.2026-11.org.ferrosan:t1\"\n\n  \
         [[target.group]]\n  name = \"all\"\n  any_initiator = true\n  \
         luns = [ {{ lun = 0, device = \"d0\" }} ]\n",
        devices.join("\n")
    )
}

fn devices(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| device(&format!("d{i}"), 1 + i % 5))
        .collect()
}

/// Reads `new` after `old` and checks it against the whole way (the same config, each device
/// from the same line, or the same errors); returns whether it was read by difference.
fn reread(old: &str, new: &str) -> bool {
    let last = read(old.to_string(), FILE, None).expect("the old text loads");
    let quick = by_difference(new, &last).is_some();
    let got = read(new.to_string(), FILE, Some(&last));
    match (got, file::from_toml_str(new, FILE)) {
        (Ok(got), Ok(whole)) => {
            assert!(got.config == whole, "configs differ for:\n{new}");
            let origins = |c: &Config| -> Vec<Option<String>> {
                c.devices.iter().map(|d| d.origin.0.clone()).collect()
            };
            assert_eq!(origins(&got.config), origins(&whole));
        }
        (Err(got), Err(whole)) => assert_eq!(got, whole),
        (got, whole) => panic!("{got:?} against the whole way's {whole:?}"),
    }
    quick
}

#[test]
fn an_edited_device_is_read_alone() {
    let old = file_of(&devices(10));
    let new = old.replace(
        "name = \"d3\"\nstore = \"ram\"\nsize = \"4M\"",
        "name = \"d3\"\nstore = \"ram\"\nsize = \"40M\"",
    );
    assert_ne!(old, new);
    assert!(reread(&old, &new));
}

#[test]
fn devices_added_and_removed_move_the_lines_of_those_after() {
    let mut list = devices(10);
    let old = file_of(&list);
    list.insert(4, device("new", 3));
    list[4].push_str("# a comment\nthin = false\n");
    assert!(reread(&old, &file_of(&list)));
    let mut fewer = devices(10);
    fewer.remove(6);
    fewer.remove(2);
    assert!(reread(&old, &file_of(&fewer)));
    // Appended after the last device, before the target.
    let mut more = devices(10);
    more.push(device("last", 2));
    assert!(reread(&old, &file_of(&more)));
    // Appended after the target, twice.
    let appended = format!("{old}\n# more\n{}", device("end", 1));
    assert!(reread(&old, &appended));
    assert!(reread(
        &appended,
        &format!("{appended}\n{}", device("end2", 1))
    ));
    // Inside the target's table: not a device's line.
    let inside = old.replace(
        "  any_initiator = true\n",
        "  any_initiator = true\n\n# x\n",
    );
    assert!(!reread(&old, &inside));
}

/// A device's table put in at every line of a file: each read as the whole way reads it
/// (most are refused: inside another table or an array).
#[test]
fn a_table_put_in_at_any_line_reads_as_the_whole_way() {
    let mut list = devices(3);
    list[1] = device("d1", 2);
    let old = file_of(&list).replace(
        "luns = [ { lun = 0, device = \"d0\" } ]",
        "luns = [\n    { lun = 0, device = \"d0\" },\n    { lun = 1, device = \"d1\" },\n  ]",
    );
    let table = device("put", 1);
    let mut quick = 0;
    for (at, _) in lines(&old) {
        for insert in [
            table.clone(),
            format!("\n{table}"),
            format!("# c\n{table}\n"),
        ] {
            let new = format!("{}{insert}{}", &old[..at], &old[at..]);
            quick += usize::from(reread(&old, &new));
        }
    }
    // 39 of 96 (every line between two tables, three ways).
    assert!(quick >= 30, "{quick} read by difference");
}

#[test]
fn a_change_beyond_the_devices_goes_the_whole_way() {
    let old = file_of(&devices(6));
    for new in [
        old.replace("rack 4", "rack 5"),
        old.replace("lun = 0, device = \"d0\"", "lun = 0, device = \"d1\""),
        old.replace("tag = 1", "tag = 2"),
    ] {
        assert!(!reread(&old, &new), "by difference:\n{new}");
    }
}

#[test]
fn refusals_are_the_whole_ways() {
    let old = file_of(&devices(6));
    let mut list = devices(6);
    list[3] = device("d1", 2);
    let twice = file_of(&list);
    list[3] = device("d9", 2).replace("\"2M\"", "\"2 bananas\"");
    let bad_size = file_of(&list);
    let mut gone = devices(6);
    gone.remove(0);
    let mapped_gone = file_of(&gone);
    let unknown = old.replace("name = \"d2\"", "name = \"d2\"\nspeed = 9");
    let broken = old.replace("name = \"d2\"", "name = \"d2");
    for new in [twice, bad_size, mapped_gone, unknown, broken] {
        assert!(!reread(&old, &new), "by difference:\n{new}");
    }
}

#[test]
fn a_multi_line_string_anywhere_goes_the_whole_way() {
    let mut list = devices(4);
    list[1].push_str("vendor = \"\"\"ACME\"\"\"\n");
    let old = file_of(&list);
    let new = old.replace("size = \"3M\"", "size = \"30M\"");
    assert!(!reread(&old, &new));
}

#[test]
fn headers_are_told_by_their_line() {
    let text =
        "[[device]]\nname = \"[[device]]\"\n  [[device]] # [[device]]\n# [[device]]\n[[device]]x\n";
    assert_eq!(device_heads(text), [0, 31]);
    assert_eq!(line_kind("[[device]]\r\n"), Line::DeviceHead);
    assert_eq!(line_kind("[[devices]]\n"), Line::OtherHead);
    assert_eq!(line_kind("[[target.group]]\n"), Line::OtherHead);
    assert_eq!(line_kind("  [1, 2],\n"), Line::OtherHead);
    assert_eq!(line_kind("name = \"x\"\n"), Line::Other);
    assert_eq!(
        device_tables_only("[[device]]\na = 1\n[[device]]\n"),
        Some(vec![0, 17])
    );
    assert_eq!(device_tables_only("[[device]]\n[server]\n"), None);
}

#[test]
fn the_changed_part_is_whole_device_tables() {
    let old = file_of(&devices(5));
    let new = old.replace("\"d2\"", "\"dd2\"");
    let part = changed_part(&old, &new).unwrap();
    assert_eq!(&old[part.start..part.old_end], device("d2", 3) + "\n");
    assert_eq!(&new[part.start..part.new_end], device("dd2", 3) + "\n");
    // A change in the [server] has no device table before it.
    assert_eq!(changed_part(&old, &old.replace("rack 4", "rack 9")), None);
}

#[test]
fn crlf_lines_and_comments_read_as_the_whole_way() {
    let old = file_of(&devices(8)).replace('\n', "\r\n");
    let new = old.replace(
        "name = \"d5\"\r\n",
        "name = \"d5\"\r\n# resized\r\nread_only = true\r\n",
    );
    assert!(reread(&old, &new));
}

/// Random edits of a text of 40 devices, 300 rounds, each checked against the whole way; most
/// are of devices only, and those are read by difference.
#[test]
fn random_edits_read_as_the_whole_way() {
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move |n: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n as u64) as usize
    };
    let mut list = devices(40);
    let mut text = file_of(&list);
    let (mut quick, mut fresh) = (0, 0);
    for round in 0..300 {
        let mut edited = list.clone();
        let at = 1 + next(edited.len() - 1);
        match next(6) {
            0 => edited[at] = device(&format!("d{at}"), 1 + next(9)),
            1 => edited.insert(at, device(&format!("n{round}"), 1 + next(9))),
            2 if edited.len() > 2 => drop(edited.remove(at)),
            3 => edited[at].push_str(&format!("# note {round}\n")),
            4 => edited[at] = device(&format!("d{}", next(3)), 1),
            _ => edited[at] = edited[at].replace("\"ram\"", "\"tape\""),
        }
        let new = file_of(&edited);
        if reread(&text, &new) {
            quick += 1;
        }
        // Keep what loads, as an operator would.
        if file::from_toml_str(&new, FILE).is_ok() {
            (list, text) = (edited, new);
            fresh += 1;
        }
    }
    assert!(fresh > 150, "{fresh} of 300 edits loaded");
    assert!(
        quick * 10 >= fresh * 9,
        "{quick} of {fresh} read by difference"
    );
}

#[test]
fn common_ends_are_counted_to_the_byte() {
    let a: Vec<u8> = (0..300u32).map(|i| (i % 251) as u8).collect();
    for at in [0, 1, 63, 64, 65, 130, 299] {
        let mut b = a.clone();
        b[at] ^= 0xff;
        assert_eq!(common_prefix(&a, &b), at);
        assert_eq!(common_suffix(&a, &b), a.len() - at - 1);
    }
    assert_eq!(common_prefix(&a, &a[..200]), 200);
    assert_eq!(common_suffix(&a, &a[100..]), 200);
}
