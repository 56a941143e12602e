// Command incluster is the e2e node's in-cluster API client: run in a pod, it calls the API
// server through the `kubernetes` Service (https://10.96.0.1:443 unless -server says
// otherwise) with the pod's ServiceAccount token, verifying the server against the
// ServiceAccount's ca.crt, and prints who it is authenticated as and the server version:
//
//	incluster: https://10.96.0.1:443 is v1.37.2; authenticated as system:serviceaccount:ns:default
//
// Exit code 0 on success, 1 on any failure. Standard library only (static, tiny).
package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"time"
)

func main() {
	server := flag.String("server", "https://10.96.0.1:443", "API server URL (the kubernetes Service's cluster IP)")
	saDir := flag.String("sa-dir", "/var/run/secrets/kubernetes.io/serviceaccount", "mounted ServiceAccount token folder")
	timeout := flag.Duration("timeout", 10*time.Second, "time limit of each request")
	flag.Parse()
	if err := run(*server, *saDir, *timeout); err != nil {
		fmt.Fprintf(os.Stderr, "incluster: %s: %v\n", *server, err)
		os.Exit(1)
	}
}

func run(server, saDir string, timeout time.Duration) error {
	token, err := os.ReadFile(filepath.Join(saDir, "token"))
	if err != nil {
		return err
	}
	caPEM, err := os.ReadFile(filepath.Join(saDir, "ca.crt"))
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("no certificate in %s/ca.crt", saDir)
	}
	client := &http.Client{
		Timeout:   timeout,
		Transport: &http.Transport{Proxy: nil, TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}},
	}
	call := func(method, path string, body []byte, out any) error {
		req, err := http.NewRequest(method, server+path, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+string(bytes.TrimSpace(token)))
		req.Header.Set("Accept", "application/json")
		if body != nil {
			req.Header.Set("Content-Type", "application/json")
		}
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		if err != nil {
			return err
		}
		if resp.StatusCode/100 != 2 {
			return fmt.Errorf("%s %s: HTTP %d: %s", method, path, resp.StatusCode, bytes.TrimSpace(data))
		}
		return json.Unmarshal(data, out)
	}
	var version struct {
		GitVersion string `json:"gitVersion"`
	}
	if err := call(http.MethodGet, "/version", nil, &version); err != nil {
		return err
	}
	// A SelfSubjectReview is allowed to every authenticated user: it proves the token worked.
	var review struct {
		Status struct {
			UserInfo struct {
				Username string `json:"username"`
			} `json:"userInfo"`
		} `json:"status"`
	}
	body := []byte(`{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`)
	if err := call(http.MethodPost, "/apis/authentication.k8s.io/v1/selfsubjectreviews", body, &review); err != nil {
		return err
	}
	if review.Status.UserInfo.Username == "" {
		return fmt.Errorf("the SelfSubjectReview names no user")
	}
	fmt.Printf("incluster: %s is %s; authenticated as %s\n", server, version.GitVersion, review.Status.UserInfo.Username)
	return nil
}
