// Command kstatus reads one Kubernetes resource (YAML or JSON) from a file or
// stdin and prints its kstatus (sigs.k8s.io/cli-utils/pkg/kstatus/status):
// Current, InProgress, Failed, Terminating, NotFound or Unknown.
//
//	kubectl get deploy/x -o yaml | kstatus          # prints: InProgress
//	kstatus -o json deploy.yaml                     # {"status":"...","message":"..."}
//
// Exit code: 0 when the status could be computed (whatever it is), 1 on a
// read/parse/compute error, 2 on bad usage. With -want STATUS the exit code is
// 0 only if the computed status equals STATUS (3 otherwise).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	"sigs.k8s.io/yaml"
)

func main() {
	output := flag.String("o", "text", "output format: text (status only), wide (status and message) or json")
	want := flag.String("want", "", "exit 3 unless the status equals this (e.g. Current)")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: kstatus [-o text|wide|json] [-want STATUS] [FILE|-]\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 1 {
		flag.Usage()
		os.Exit(2)
	}
	var in io.Reader = os.Stdin
	if name := flag.Arg(0); name != "" && name != "-" {
		f, err := os.Open(name)
		if err != nil {
			fail(err)
		}
		defer f.Close()
		in = f
	}
	data, err := io.ReadAll(in)
	if err != nil {
		fail(err)
	}
	// YAML (JSON is YAML) -> JSON, then the apimachinery decoder, which keeps
	// integers as int64 as the kstatus accessors expect.
	j, err := yaml.YAMLToJSON(data)
	if err != nil {
		fail(fmt.Errorf("parse resource: %w", err))
	}
	u := &unstructured.Unstructured{}
	if err := u.UnmarshalJSON(j); err != nil {
		fail(fmt.Errorf("decode resource (expected one object with apiVersion and kind): %w", err))
	}
	if u.IsList() {
		fail(fmt.Errorf("input is a %s; give one resource", u.GetKind()))
	}
	res, err := status.Compute(u)
	if err != nil {
		fail(fmt.Errorf("compute status of %s %s: %w", u.GetKind(), u.GetName(), err))
	}
	switch *output {
	case "text":
		fmt.Println(res.Status)
	case "wide":
		fmt.Printf("%s\t%s\n", res.Status, res.Message)
	case "json":
		b, _ := json.Marshal(map[string]interface{}{
			"status":     res.Status.String(),
			"message":    res.Message,
			"conditions": res.Conditions,
		})
		fmt.Println(string(b))
	default:
		flag.Usage()
		os.Exit(2)
	}
	if *want != "" && res.Status.String() != *want {
		os.Exit(3)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "kstatus:", err)
	os.Exit(1)
}
